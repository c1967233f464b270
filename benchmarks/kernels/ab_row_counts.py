"""The forward's per-row trip counts (``skip_tail``): one counting launch against ``row_blocks``' torch ops,
interleaved in one process on the prefill shapes of ``ab_sparse_attention_fwd.py``.

    python benchmarks/kernels/ab_row_counts.py [--rounds 7] [--replays 15]

Printed per shape, median over rounds: the forward with each way of counting, captured in a CUDA graph
(device time only) and called eagerly (host time included, as an eager caller sees it), and the counting
alone in a graph.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _eager_ms(fn, reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=15)
    args = ap.parse_args(argv)

    from ab_sparse_attention_fwd import cases

    from dsa_plugins.bench.runner import capture_graph, graph_replay_ms
    from dsa_plugins.common.indices import row_blocks
    from dsa_plugins.kernels import sparse_attention_fwd as F
    from dsa_plugins.kernels.row_scan import row_blocks_cuda

    def torch_counts(idx, step, target="auto"):
        return row_blocks(idx, step, None)

    ways = {"one_launch": row_blocks_cuda, "torch": torch_counts}
    for label, make, dv in cases("prefill"):
        q, kv, idx, sink = make()
        scale, dv = F._check_inputs(q, kv, idx, q.shape[-1] ** -0.5, sink, dv)
        out = torch.empty(*q.shape[:3], dv, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        flat = idx.reshape(-1, idx.shape[-1]).to(torch.int32).contiguous()
        assert torch.equal(row_blocks_cuda(flat, 64), row_blocks(flat, 64, None)), label
        fwd, count, eager = {}, {}, {}
        times = {(kind, n): [] for kind in ("fwd", "count", "eager") for n in ways}
        try:
            for name, way in ways.items():
                F.row_blocks_cuda = way
                call = lambda: F._launch(q, kv, idx, scale, sink, dv, out, lse)  # noqa: E731
                fwd[name] = capture_graph(call)
                # the counts alone, in blocks of 64 slots over the unpadded rows (the forward's wrapper counts
                # its own step over padded rows: the same one launch or the same torch ops)
                count[name] = capture_graph(lambda way=way: way(flat, 64))
                eager[name] = call
            for r in range(args.rounds):
                for name in ways if r % 2 == 0 else reversed(list(ways)):
                    F.row_blocks_cuda = ways[name]
                    times["fwd", name].append(graph_replay_ms(fwd[name], args.replays))
                    times["count", name].append(graph_replay_ms(count[name], args.replays))
                    times["eager", name].append(_eager_ms(eager[name], args.replays))
        finally:
            F.row_blocks_cuda = row_blocks_cuda
        med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        print(f"{label}: graph fwd one_launch {med['fwd', 'one_launch']:.1f} us torch {med['fwd', 'torch']:.1f} us"
              f" | counts alone {med['count', 'one_launch']:.1f} / {med['count', 'torch']:.1f} us"
              f" | eager fwd {med['eager', 'one_launch']:.1f} / {med['eager', 'torch']:.1f} us", flush=True)
        del q, kv, idx, out, lse, fwd, count
    return 0


if __name__ == "__main__":
    sys.exit(main())
