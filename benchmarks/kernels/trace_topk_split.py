"""Where the split top-k's CTAs spend their time: clock64 stamps per phase (an experiment, not shipped).

    python benchmarks/kernels/trace_topk_split.py [--cases 1x32768,32x32768] [--parts 2,4]

A copy of ``kernels/topk.py`` (``source_patch``) gets an int64 ``Trace`` [CTAs, 10] argument; thread 0 of each CTA
writes ``clock64`` there at the phase boundaries of ``radix_topk_split`` (0 start, 1 counters cleared, 2 pass 1 read, 3 digit 1 found over the
cluster, 4 pass 2 emitted / gathered, 5 / 6 rounds 2 / 3 (a skipped round 3 takes round 2's stamp: a lap of 0), 7 final pass, 8 ordered write, 9 end). Printed: the median over CTAs of each phase's cycles, and the CTA's whole time, for
indexer-like scores (``bench_topk_configs.scores``) after a warm call; the selection is checked against the shipped
program's.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_topk_configs import scores  # noqa: E402
from source_patch import import_patched, replace_exact  # noqa: E402

PHASES = ["clear", "pass 1", "digit 1", "pass 2", "round 2", "round 3", "final", "order", "end"]

_STAMP_PRELUDE = r'''
__device__ __forceinline__ long long dsa_clock64() {
  long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); return c; }
'''


def _stamp(i: int, indent: int) -> str:
    pad = " " * indent
    return f"{pad}if tx == 0:\n{pad}    Trace[bx, {i}] = T.call_extern(T.int64, \"dsa_clock64\")\n"


def traced_source() -> str:
    import dsa_plugins.kernels.topk as TK

    src = open(TK.__file__).read()
    src = replace_exact(src, "            Ties: T.Tensor([R, 2], T.int32),\n        ):\n            with T.Kernel(R * parts,",
                        "            Ties: T.Tensor([R, 2], T.int32),\n            Trace: T.Tensor([R * parts, 10], T.int64),\n"
                        "        ):\n            with T.Kernel(R * parts,")
    src = replace_exact(src, "prelude=CLUSTER_PRELUDE + _SPLIT_PRELUDE + _ORDER_PRELUDE,",
                        "prelude=CLUSTER_PRELUDE + _SPLIT_PRELUDE + _ORDER_PRELUDE + _STAMP,")
    src = replace_exact(src, "_SPLIT_PRELUDE = r\"\"\"", f"_STAMP = r\"\"\"{_STAMP_PRELUDE}\"\"\"\n_SPLIT_PRELUDE = r\"\"\"")
    src = replace_exact(src, "                out_offset = Offsets[row * offset_stride]\n",
                        "                out_offset = Offsets[row * offset_stride]\n" + _stamp(0, 16))
    src = replace_exact(src, "                    # after pass 1, which also makes sure that every CTA of the cluster has started)\n"
                        "                    T.sync_threads()\n",
                        "                    # after pass 1, which also makes sure that every CTA of the cluster has started)\n"
                        "                    T.sync_threads()\n" + _stamp(1, 20))
    src = replace_exact(src, "                    T.call_extern(\"handle\", \"dsa_cluster_sync\")\n                    sum_peers(hist, tot, tx, _NB1, 0)\n",
                        _stamp(2, 20) + "                    T.call_extern(\"handle\", \"dsa_cluster_sync\")\n"
                        "                    sum_peers(hist, tot, tx, _NB1, 0)\n")
    src = replace_exact(src, "                    use_cand = T.if_then_else(ctl[6] <= cap, 1, 0)\n",
                        "                    use_cand = T.if_then_else(ctl[6] <= cap, 1, 0)\n" + _stamp(3, 20))
    src = replace_exact(src, "                    prefix = b1\n\n                    # ---- rounds 2 and 3: 10-bit digits, histograms",
                        "                    prefix = b1\n" + _stamp(4, 20)
                        + "\n                    # ---- rounds 2 and 3: 10-bit digits, histograms")
    src = replace_exact(src, "                        if r == 0 and ctl[5] == 0:\n                            kshift = 10\n",
                        "                        if r == 0 and ctl[5] == 0:\n                            kshift = 10\n"
                        + "                        if tx == 0:\n                            Trace[bx, 5 + r] = T.call_extern(T.int64, \"dsa_clock64\")\n")
    src = replace_exact(src, "                    # ---- each CTA's bits to its slots",
                        _stamp(7, 20) + "                    # ---- each CTA's bits to its slots")
    src = replace_exact(src, "                    T.call_extern(\"handle\", \"dsa_cluster_sync\")  # CTA 0's counter outlives every peer's adds\n",
                        _stamp(8, 20) + "                    T.call_extern(\"handle\", \"dsa_cluster_sync\")  # CTA 0's counter outlives every peer's adds\n"
                        + _stamp(9, 20))
    src = replace_exact(src, "        build_topk(cfg)(view, starts, ends, offsets, stride, out, ties)\n",
                        "        build_topk(cfg)(view, starts, ends, offsets, stride, out, ties, TRACE[0])\n")
    return src + "\nTRACE = [None]\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32768,32x32768,1x131072")
    ap.add_argument("--parts", default="2,4,8")
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    import dsa_plugins.kernels.topk as TK

    mod = import_patched(traced_source(), "topk_traced")
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| rows x cols | parts | " + " | ".join(PHASES) + " | CTA total | cycles |")
    print("|" + "---|" * (len(PHASES) + 4))
    for case in args.cases.split(","):
        rows, cols = (int(n) for n in case.split("x"))
        x = scores("indexer-like", rows, cols, g)
        starts = torch.zeros(rows, dtype=torch.int32, device="cuda")
        ends = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
        for parts in (int(p) for p in args.parts.split(",")):
            cfg = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": parts}
            mod.TRACE[0] = torch.zeros(rows * parts, 10, dtype=torch.int64, device="cuda")
            ref = TK.topk_rows_ranges(x, starts, ends, args.k, config=cfg)
            for _ in range(3):
                got = mod.topk_rows_ranges(x, starts, ends, args.k, config=cfg)
            torch.cuda.synchronize()
            assert torch.equal(got, ref), (case, parts)
            t = mod.TRACE[0].cpu().double()
            skipped = (t[:, 6] == 0).double().mean().item()  # round 3 skipped: its lap goes to the final pass
            t[:, 6] = torch.where(t[:, 6] == 0, t[:, 5], t[:, 6])
            laps = (t[:, 1:] - t[:, :-1]).median(dim=0).values
            total = (t[:, 9] - t[:, 0]).median().item()
            print(f"| {rows} x {cols} | {parts} | " + " | ".join(f"{v:.0f}" for v in laps.tolist())
                  + f" | {total:.0f} | {total / 1.98e3:.1f} us at 1.98 GHz, round 3 skipped by {skipped:.0%} |", flush=True)


if __name__ == "__main__":
    main()
