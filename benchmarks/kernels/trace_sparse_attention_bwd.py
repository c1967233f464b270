"""Where the backward's warp-specialised CTAs spend their cycles: clock64 laps per phase (an experiment, not shipped).

    python benchmarks/kernels/trace_sparse_attention_bwd.py [--shapes mla_h64,v4_h128_sink] [--variants JSON] [--fine]

A copy of ``dsa_plugins/kernels/sparse_attention_bwd.py`` is patched as text (``traced_source``): each thread of
the ws program keeps the clock64 cycles of its warpgroup's phases in registers, summed over the row's slot blocks,
and threads 0 and 128 write them to an extra int64 tensor Trace [CTAs, 16] when their warpgroup is done
(32-bit clock laps in 10 registers: the program sits at 255, so the laps may move its register allocation):

    warpgroup 0 (gathers, scores, P and dS, dq[:, :dv/2]):
      0 waiting for the kv buffer (warpgroup 1's dq MMA of the previous block)
      1 the gather: issue to landed
      2 S and dP MMAs and the softmax
      3 waiting for warpgroup 1 to release P and dS
      4 P and dS stored, dq MMA (and the prologue before the first block)
    warpgroup 1 (dq[:, dv/2:], dkv chunks and their reductions):
      5 waiting for P and dS
      6 dq MMA and the first chunk's MMA (until the kv buffer is released)
      7 the chunks: MMAs and reductions (and the prologue before the first block)
    8 / 9 CTA start / end clock (warpgroup 1), 10 slot blocks walked, 11 SM id
    with ``--fine``, phase 7 split inside each chunk: 12 the next chunk's MMA issue and this chunk's MMA wait,
      13 this chunk's reductions (their issue; in the paired program the exchange and its waits too)

Caveat (Nsight Compute's stall sampling, 2026-11-26): the named barriers compile to BAR.SYNC.DEFER_BLOCKING, after
which a warp goes on issuing a few instructions (the clock read among them) before it blocks, so a barrier's wait
can land in the lap after it: warpgroup 0's wait for P/dS to be free showed up in "store + dq", not "P dS wait".

It prints, per variant, the median over CTAs of each phase's cycles per slot block and the CTA's cycles per block.
The copy is compiled as its own module; the shipped program is untouched (the traced one is checked against it).
A CPU test keeps the patches applying (``tests/test_forward_tools.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "dsa_plugins" / "kernels" / "sparse_attention_bwd.py"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_patch import import_patched, replace_exact  # noqa: E402

_PRELUDE = r'''
_TRACE_PRELUDE = r"""
// 32-bit SM clock: laps are differences (wrap-safe), a CTA's sums stay far below 2^31 cycles
__device__ __forceinline__ int dsa_clk() {
  unsigned c; asm volatile("mov.u32 %0, %%clock;" : "=r"(c) :: "memory"); return (int)c; }
// acc[slot] += cycles since *last; *last = now
__device__ __forceinline__ void dsa_lap(int* acc, int slot, int* last) {
  const int c = dsa_clk(); acc[slot] += (int)((unsigned)c - (unsigned)*last); *last = c; }
__device__ __forceinline__ int dsa_smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return (int)s; }
"""
TRACE = [None]  # the Trace tensor the wrapper passes to the atomic ws program
'''

PHASES = ("kv wait", "gather", "S dP softmax", "P dS wait", "store + dq", "P dS ready wait", "dq + chunk 0",
          "chunks + reductions")
FINE_PHASES = ("chunk MMA issue + wait", "chunk reductions")


def _lap(slot: int) -> str:
    return f'T.call_extern("handle", "dsa_lap", tr.data, {slot}, T.address_of(tr[9]))'


_replace = replace_exact


def traced_source(fine: bool = False) -> str:
    """The backward module's source with the clock laps patched into the ws program (``fine``: also inside
    each dkv chunk)."""
    s = SOURCE.read_text()
    s = _replace(s, "# named barriers of the ws program", _PRELUDE + "\n# named barriers of the ws program")
    scales = ("        Scales: (T.Tensor([ND, dqk // (4 if pair and not dkv_perm else 8)], T.uint8) if det_out == "
              '"contrib_i16"\n                 else T.Tensor([2], f32)),\n')
    s = _replace(s, scales, scales + "        Trace: T.Tensor([NHB * Tq, 16], T.int64),\n")
    s = _replace(s, "prelude=_WS_PRELUDE, cluster_dims", "prelude=_WS_PRELUDE + _TRACE_PRELUDE, cluster_dims")
    keep = "keep = T.alloc_local([16], f32) if pair else None  # this CTA's half of the chunk in flight\n"
    s = _replace(s, keep, keep + f"            tr = T.alloc_local([{12 if fine else 10}], i32)  # the phases' sums, 8: CTA "
                 "start, 9: last stamp, 10 / 11: the chunk laps (fine)\n")
    nb = "n_blocks = n_row[0] if skip_tail else T.ceildiv(Kp, BK)\n"
    s = _replace(s, nb, nb + f"            for i in T.serial({12 if fine else 8}):\n                tr[i] = 0\n"
                 '            tr[9] = T.call_extern(i32, "dsa_clk")\n            tr[8] = tr[9]\n')
    # warpgroup 0
    kv = ("                for kb in T.serial(n_blocks):\n                    if kb > 0:\n"
          "                        T.sync_threads(_BAR_KV_FREE, 256)  # warpgroup 1 has read the previous kv block\n")
    s = _replace(s, kv, "                for kb in T.serial(n_blocks):\n                    " + _lap(4) + "\n"
                 "                    if kb > 0:\n"
                 "                        T.sync_threads(_BAR_KV_FREE, 256)  # warpgroup 1 has read the previous kv block\n"
                 "                    " + _lap(0) + "\n")
    landed = ("                    T.sync_threads(_BAR_WG0, 128)\n"
              "                    T.wgmma_gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True)\n")
    s = _replace(s, landed, "                    T.sync_threads(_BAR_WG0, 128)\n                    " + _lap(1) + "\n"
                 "                    T.wgmma_gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True)\n")
    pds = ("                    if kb > 0:\n"
           "                        T.sync_threads(_BAR_PDS_FREE, 256)  # warpgroup 1 is done with the previous P, dS\n")
    s = _replace(s, pds, "                    " + _lap(2) + "\n" + pds + "                    " + _lap(3) + "\n")
    # dq's stores: staged through q_s (ws_stage_dq, the default) or from the fragments; the laps come before either
    dq0 = "                if stage_dq:\n                    T.sync_threads(_BAR_DQ, 256)  # both warpgroups"
    s = _replace(s, dq0, "                " + _lap(4) + "\n" + dq0)
    # warpgroup 1
    ready = "                for kb in T.serial(n_blocks):\n                    T.sync_threads(_BAR_PDS_READY, 256)\n"
    s = _replace(s, ready, "                for kb in T.serial(n_blocks):\n                    " + _lap(7) + "\n"
                 "                    T.sync_threads(_BAR_PDS_READY, 256)\n                    " + _lap(5) + "\n")
    free = ("                    if kb + 1 < n_blocks:\n                        T.named_barrier_arrive(_BAR_KV_FREE, 256)\n"
            "                    for ci in chunk_ids1:\n")
    s = _replace(s, free, free.replace("                    for ci in chunk_ids1:\n",
                                       "                    " + _lap(6) + "\n                    for ci in chunk_ids1:\n"))
    if fine:
        mma = "                        if store_dkv and pair:\n"
        s = _replace(s, mma, "                        " + _lap(10) + "\n" + mma)
        red = "                            reduce_chunk(ci, acc_kv[ci % 2], kb, t, hb, dKV, Idx, FixedSums, Scales)\n"
        s = _replace(s, red, red + "                        " + _lap(11) + "\n")
    dq1 = "                if stage_dq:\n                    T.sync_threads(_BAR_DQ, 256)\n"
    s = _replace(s, dq1, "                " + _lap(7) + "\n" + dq1)
    wg0 = "                store_dq(dQ, t, h0, q_s if stage_dq else acc_dq0, 0, 0, DQ0)\n"
    s = _replace(s, wg0, wg0 + "                if tx == 0:\n                    for i in T.serial(5):\n"
                 "                        Trace[bx, i] = tr[i]\n")
    wg1 = "                    store_dq(dQ, t, h0, qt_s if stage_dq else acc_dqt, 0, dv, DT)\n"
    s = _replace(s, wg1, wg1 + "                if tx == 128:\n                    for i in T.serial(3):\n"
                 "                        Trace[bx, 5 + i] = tr[5 + i]\n"
                 "                    Trace[bx, 8] = tr[8]\n"
                 '                    Trace[bx, 9] = T.call_extern(i32, "dsa_clk")\n'
                 "                    Trace[bx, 10] = n_blocks\n"
                 '                    Trace[bx, 11] = T.call_extern(i32, "dsa_smid")\n'
                 + ("                    Trace[bx, 12] = tr[10]\n                    Trace[bx, 13] = tr[11]\n" if fine else ""))
    call = "*_no_fixed_point(dev),\n             *fused)\n"  # the atomic launch: Trace sits before out, lse and sink
    s = _replace(s, call, call.replace("(dev),", "(dev), TRACE[0],"))
    return s


def traced_module(fine: bool = False):
    """Import the patched copy as a module of its own (TileLang reads the source from the file)."""
    return import_patched(traced_source(fine), f"traced_bwd_{'fine' if fine else 'phases'}")


def main(argv=None) -> int:
    import numpy as np
    import torch

    from bench_sparse_attention_bwd import SHAPES, make_inputs
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="mla_h64,v4_h128_sink")
    ap.add_argument("--variants", default="[{}]", help="JSON list of config overrides (atomic mode)")
    ap.add_argument("--fine", action="store_true", help="also lap inside each dkv chunk (slots 12, 13)")
    args = ap.parse_args(argv)
    mod = traced_module(args.fine)
    phases = PHASES + (FINE_PHASES if args.fine else ())
    slots = tuple(range(8)) + ((12, 13) if args.fine else ())
    print("| shape | variant | CTA cycles / block | " + " | ".join(phases) + " |")
    print("|" + "---|" * (len(phases) + 3))
    for name in args.shapes.split(","):
        _, B, S, Skv, H, Dqk, Dv, K, sink = next(s for s in SHAPES if s[0] == name)
        q, kv, idx, out, lse, dout, z, scale = make_inputs(B, S, Skv, H, Dqk, Dv, K, sink, causal="causal" in name)
        for variant in json.loads(args.variants):
            nhb = -(-H // 64)
            trace = torch.zeros(nhb * B * S, 16, dtype=torch.int64, device="cuda")
            mod.TRACE[0] = trace
            traced = None
            for _ in range(3):  # compile, warm, traced (the last launch's stamps stay)
                traced = mod.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv, config=variant)
            ref = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv, config=variant)
            assert torch.equal(traced[0], ref[0]), "the traced program's dq differs from the shipped one's"
            c = trace.cpu().numpy().astype(np.float64)
            blocks = np.maximum(1, c[:, 10])
            per_block = [float(np.median(c[:, i] / blocks)) for i in slots]
            total = float(np.median(((c[:, 9] - c[:, 8]) % 2**32) / blocks))
            print(f"| {name} | {json.dumps(variant)} | {total:.0f} | " + " | ".join(f"{v:.0f}" for v in per_block)
                  + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
