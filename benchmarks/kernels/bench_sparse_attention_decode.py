"""The forward of a generation step: one query per sequence, k selected keys from a long cache.

    python benchmarks/kernels/bench_sparse_attention_decode.py [--heads 64,128] [--batches 1,8,32,64,128]
        [--cache 32768,131072] [--out DIR]

Times CUDA-graph replay of ``sparse_attention_fwd`` (what a captured decode step runs): the default
one-CTA-per-row walk (variant ``one_part``) beside the split that DSA_PLUGINS_DECODE_PART_SLOTS turns
on (one-query rows cut into parts of ``--part-slots`` slots, scored by CTAs of their own and merged
by the combine program; variant ``split<n>``). Bandwidth is counted on the bytes a step must read:
the selected kv rows (Dqk bf16 each), q and out. Rows go to ``benchmarks/results/attention_decode.csv``.
Shapes whose cache has 2**31 elements or more (a single launch's limit) are skipped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from common import Rows  # noqa: E402

from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch  # noqa: E402


def graph_us(fn, reps: int = 50) -> float:
    """Median-free mean over ``reps`` replays of one captured call, in microseconds."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--cache", default="32768")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--part-slots", default="512,1024")
    ap.add_argument("--dims", default="576/512", help="Dqk/Dv (512/512 adds a sink, as DeepSeek-V4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dqk, dv = (int(x) for x in args.dims.split("/"))
    sink_on = dqk == dv
    rows = Rows("attention_decode", args.out)
    peak = 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12  # nominal HBM3 / HBM3e bytes/s
    gen = torch.Generator(device="cuda").manual_seed(0)
    for skv in (int(x) for x in args.cache.split(",")):
        for h in (int(x) for x in args.heads.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                if b * skv * dqk >= 2**31:
                    print(f"B{b} H{h} cache{skv}: skipped (a {b} x {skv} x {dqk} cache is one launch's limit)")
                    continue
                q = torch.randn(b, 1, h, dqk, device="cuda", generator=gen).bfloat16()
                kv = torch.randn(b, skv, dqk, device="cuda", generator=gen).bfloat16()
                idx = torch.stack([torch.randperm(skv, device="cuda", generator=gen)[: args.k] for _ in range(b)])
                idx = idx.int().view(b, 1, args.k)
                sink = torch.randn(h, device="cuda", generator=gen) if sink_on else None
                scale, _ = _check_inputs(q, kv, idx, dqk**-0.5, sink, dv)
                out = torch.empty(b, 1, h, dv, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, 1, h, device="cuda")
                need = b * args.k * dqk * 2 + b * h * (dqk + dv) * 2
                shape = f"B{b} H{h} D{dqk}/{dv} k{args.k} cache{skv}"
                splits = [(f"split{n}", int(n)) for n in args.part_slots.split(",")]
                for variant, slots in [("one_part", 0)] + splits:
                    fn = lambda: _launch(q, kv, idx, scale, sink, dv, out, lse, part_slots=slots)  # noqa: E731
                    us = graph_us(fn)
                    row = {"op": "sparse_attention_decode", "mode": "fwd", "shape": shape, "provider": "tilelang",
                           "variant": variant, **rows.env, "median_ms": us / 1e3, "gbps": need / (us * 1e-6) / 1e9,
                           "tflops": 2.0 * b * h * args.k * (dqk + dv) / (us * 1e-6) / 1e12}
                    rows.rows.append(row)
                    print(f"{shape:<40} {variant:<9} {us:8.1f} us  {need / 1e6:7.1f} MB  "
                          f"{need / (us * 1e-6) / 1e12:5.2f} TB/s ({100 * need / (us * 1e-6) / peak:4.1f}% of HBM)",
                          flush=True)
                del q, kv, idx, out, lse
                torch.cuda.empty_cache()
            rows.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
