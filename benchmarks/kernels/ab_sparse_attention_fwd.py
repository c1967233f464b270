"""Forward variants against the default, interleaved in one process (decisions of a few percent).

    python benchmarks/kernels/ab_sparse_attention_fwd.py '[{"tma_io": false}]' [--shapes prefill|decode]
        [--rounds 7] [--replays 15] [--jobs 8] [--batches 1,8,64] [--cache 32768] [--models mla,v4]
    python benchmarks/kernels/ab_sparse_attention_fwd.py '[{"cluster": "heads"}]' --shapes long

Single runs of a benchmark move by a few percent from one process to the next, so a compile-time
variant is judged here against the default in the same process: each program is captured in a CUDA
graph (no host time in the figures), and each round times ``--replays`` back-to-back replays of every
program, in alternating order. Printed per shape: the default's median time, each variant's, and the
default / variant time ratio per round as median [min, max] (> 1: the variant is faster).

Shapes: ``prefill`` the peers benchmark's k sweep (V4 D512 sink, H 64, k 256-2048) and 8K shapes (B1
S4096 Skv8192); ``long`` its MLA H128 k2048 shapes over 32K / 64K / 128K cache rows (past L2: the gathers come
from HBM); ``decode`` one query per sequence over a 32K cache (``--cache``), k 2048, H 64 / 128, MLA 576/512
and with ``--models mla,v4`` also DeepSeek-V4's D512 with sink, B 1 / 8 / 64 (``--batches``; caches of 2**31 elements or more too: the gathers are addressed in 64 bits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))


# decode's kernel families: MLA 576/512 (no sink) and DeepSeek-V4 D512 with its per-head sink
DECODE_DIMS = {"mla": (576, 512, False), "v4": (512, 512, True)}


def _decode_inputs(b: int, skv: int, h: int, dqk: int, k: int, sink: bool = False):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, dqk, device="cuda", generator=g).bfloat16()
    kv = torch.randn(b, skv, dqk, device="cuda", generator=g).bfloat16()
    idx = torch.rand(b, skv, device="cuda", generator=g).topk(k, dim=-1).indices.to(torch.int32).view(b, 1, k)
    return q, kv, idx, torch.randn(h, device="cuda", generator=g) if sink else None


def cases(which: str, batches=(1, 8, 64), cache: int = 32768, models=("mla",)):
    """(label, (q, kv, idx, sink), dv) per shape, inputs made lazily; ``batches``, ``cache`` and ``models``
    (keys of DECODE_DIMS) for decode."""
    from bench_attention_peers import SHAPES_8K, SHAPES_K, SHAPES_LONG, make_inputs

    if which == "decode":
        for dqk, dv, sink in (DECODE_DIMS[m] for m in models):
            for h in (64, 128):
                for b in batches:  # caches of 2**31+ elements too: the gathers are addressed in 64 bits
                    yield (f"B{b} S1 H{h} D{dqk}/{dv}{' sink' if sink else ''} k2048 cache{cache}",
                           lambda b=b, h=h, dqk=dqk, sink=sink: _decode_inputs(b, cache, h, dqk, 2048, sink), dv)
        return
    for _op, s, skv, h, dqk, dv, k, sink in (SHAPES_LONG if which == "long" else SHAPES_K + SHAPES_8K[:3]):
        yield (f"B1 S{s} Skv{skv} H{h} D{dqk}/{dv} k{k}",
               lambda a=(s, skv, h, dqk, dv, k, sink): make_inputs(*a), dv)


def precompile(which: str, variants, jobs: int) -> None:
    """Compile every program the rounds will run, ``jobs`` processes at a time, for the target the wrapper
    passes (warmup's jobs; TileLang's disk cache keeps them for the rounds)."""
    from bench_attention_peers import SHAPES_8K, SHAPES_K

    from dsa_plugins.kernels import sparse_attention_fwd as F
    from dsa_plugins.warmup import KernelJob, compile_jobs

    dims = set(DECODE_DIMS.values()) if which == "decode" else {(d[4], d[5], d[7]) for d in SHAPES_K + SHAPES_8K[:3]}
    todo = []
    for dqk, dv, sink in sorted(dims):
        for v in variants:  # (decode rows cut into parts compile their own programs on first use)
            try:
                cfg = F.config_for(dqk, dv, sink, torch.bfloat16, v)
            except ValueError as exc:  # reported again when the variant is captured
                print(f"precompile {dqk}/{dv} {json.dumps(v)}: {exc}", flush=True)
                continue
            todo.append(KernelJob(f"forward {dqk}/{dv} {json.dumps(v)}", F.__name__, "build_fwd_kernel", (cfg,)))
    compile_jobs(todo, jobs, on_gpu=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", help='JSON list of compile-time overrides, e.g. [{"tma_io": false}]')
    ap.add_argument("--shapes", default="prefill", choices=["prefill", "long", "decode"])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=0, help="compile the programs this many at a time first")
    ap.add_argument("--batches", default="1,8,64", help="decode: sequences per step, comma list")
    ap.add_argument("--cache", type=int, default=32768, help="decode: cache rows per sequence")
    ap.add_argument("--models", default="mla", help="decode: kernel families, comma list of " + ",".join(DECODE_DIMS))
    args = ap.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    variants = [None] + json.loads(args.variants)
    if args.jobs:
        precompile(args.shapes, variants, args.jobs)

    from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, ratio_text
    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch

    for label, make, dv in cases(args.shapes, batches, args.cache, tuple(args.models.split(","))):
        q, kv, idx, sink = make()
        scale, dv = _check_inputs(q, kv, idx, q.shape[-1] ** -0.5, sink, dv)
        out = torch.empty(*q.shape[:3], dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        graphs = []
        for v in variants:
            try:
                graphs.append(capture_graph(lambda v=v: _launch(q, kv, idx, scale, sink, dv, out, lse, overrides=v)))
            except ValueError as exc:  # a variant this shape cannot take (e.g. clusters of an odd head-block count)
                graphs.append(None)
                print(f"{label}: {json.dumps(v)} n/a: {exc}", flush=True)
        times = interleaved_graph_ms(graphs, args.rounds, args.replays)
        line = f"{label}: default {statistics.median(times[0]):.4f} ms"
        for v, t in zip(variants[1:], times[1:]):
            if not t:
                continue
            line += f" | {json.dumps(v)} {statistics.median(t):.4f} ms, default/variant {ratio_text(times[0], t)}"
        print(line, flush=True)
        del q, kv, idx, out, lse, graphs
    return 0


if __name__ == "__main__":
    sys.exit(main())
