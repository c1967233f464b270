"""The radix top-k's shipped CTA shapes on few long rows (generation steps: one row per sequence).

    python benchmarks/kernels/bench_topk_configs.py [--k 2048]

For each (rows, columns) case and each configuration of ``kernels.topk.SHIPPED_CONFIGS`` (without lse): the
select + tie-fill pair replayed from a CUDA graph (mean us per call), and which one ``config_for_rows``
picks. Scores: indexer-like (sums of ReLU'd products: non-negative, a few exact zeros) and normal. Every
configuration must return the same sets (checked against the first).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from dsa_plugins.bench.runner import capture_graph, graph_replay_ms  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402

CASES = [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (16, 131072), (32, 32768), (32, 131072), (64, 32768)]


def scores(kind, rows, cols, g):
    if kind == "normal":
        return torch.randn(rows, cols, device="cuda", generator=g)
    x = torch.randn(rows, cols, 8, device="cuda", generator=g).relu_()  # 8 heads' ReLU'd scores
    w = torch.rand(8, device="cuda", generator=g)
    return (x * w).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--extra", default="[]", help="JSON list of more configurations to time beside the shipped ones")
    ap.add_argument("--kinds", default="indexer-like,normal")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    configs = [c for c in TK.SHIPPED_CONFIGS if not c.get("lse")] + json.loads(args.extra)
    print("| scores | rows | columns | " + " | ".join(f"{c['threads']}t agg={c.get('agg')}" + (f" parts={c['parts']}" if c.get('parts') else "")
                                           for c in configs)
          + " | picked |")
    print("|" + "---|" * (len(configs) + 4))
    for kind in args.kinds.split(","):
        for rows, cols in CASES:
            x = scores(kind, rows, cols, g)
            starts = torch.zeros(rows, dtype=torch.int32, device="cuda")
            ends = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
            times, ref = [], None
            for cfg in configs:
                out = torch.empty(rows, args.k, dtype=torch.int32, device="cuda")
                fn = lambda: TK.topk_rows_ranges(x, starts, ends, args.k, out=out, config=cfg)  # noqa: E731
                graph = capture_graph(fn)
                times.append(1e3 * graph_replay_ms(graph, 50))
                got = out.sort(1).values
                ref = got if ref is None else ref
                assert torch.equal(got, ref), (kind, rows, cols, cfg)
            picked = configs.index(TK.config_for_rows(rows, cols))
            print(f"| {kind} | {rows} | {cols} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {picked} |", flush=True)


if __name__ == "__main__":
    main()
