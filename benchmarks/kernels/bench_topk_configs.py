"""The radix top-k's shipped CTA shapes on few long rows (generation steps: one row per sequence).

    python benchmarks/kernels/bench_topk_configs.py [--k 2048]
    python benchmarks/kernels/bench_topk_configs.py --prefill 8192,32768 --extra '[{"threads": 256, ...}]'
    python benchmarks/kernels/bench_topk_configs.py --cases 32x131072 --configs '[{"parts": 2}, ...]' --kinds indexer-like

For each (rows, columns) case and each configuration of ``kernels.topk.SHIPPED_CONFIGS`` (without lse): the
select + tie-fill pair replayed from a CUDA graph (mean us per call), and which one ``config_for_rows``
picks. Scores: indexer-like (sums of ReLU'd products: non-negative, a few exact zeros) and normal. Every
configuration must return the same sets (checked against the first).
"""

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from dsa_plugins.bench.runner import capture_graph, graph_replay_ms  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402

CASES = [(1, 32768), (1, 131072), (8, 32768), (8, 131072), (16, 131072), (32, 32768), (32, 131072), (64, 32768)]


def scores(kind, rows, cols, g):
    if kind == "normal":
        return torch.randn(rows, cols, device="cuda", generator=g)
    x = torch.randn(rows, cols, 8, device="cuda", generator=g).relu_()  # 8 heads' ReLU'd scores
    w = torch.rand(8, device="cuda", generator=g)
    return (x * w).sum(-1)


def build_in_parallel(configs: list) -> None:
    """Compile the configurations' programs up front, in threads (nvcc runs outside the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, len(configs))) as pool:
        list(pool.map(TK.build_topk, configs))


def prefill(T: int, k: int, configs: list, rounds: int = 7, replays: int = 20, lse: bool = False) -> None:
    """The top-k of a causal prefill's indexer scores (T rows, Hi 64, Di 128, the score program's own buffer) with
    each configuration, captured in CUDA graphs and timed in alternating rounds; the rows checked equal (``lse``:
    the programs that also write each row's logsumexp, as the indexer loss asks; the lse checked close: its bits are
    the same from run to run, not across CTA shapes, whose threads sum other columns)."""
    import statistics

    from bench_indexer import inputs
    from dsa_plugins.bench.runner import interleaved_graph_ms, ratio_text
    from dsa_plugins.kernels import indexer as K

    build_in_parallel(configs)
    plan = K._Plan(*inputs(T, 64, 128), None, 1 << 62)
    r0, r1, buf = plan.chunk_scores(plan.chunks[0])
    outs = [torch.empty(T, k, dtype=torch.int32, device="cuda") for _ in configs]
    lses = [torch.empty(T, device="cuda") if lse else None for _ in configs]
    graphs = [capture_graph(lambda cfg=cfg, out=out, ls=ls: plan.chunk_topk(r0, r1, buf, k, out, config=cfg, lse=ls))
              for cfg, out, ls in zip(configs, outs, lses)]
    for cfg, out, ls in zip(configs, outs, lses):  # the same rows, in the same (ascending column) order
        assert torch.equal(out, outs[0]), cfg
        if ls is not None:
            torch.testing.assert_close(ls, lses[0], rtol=4e-6, atol=4e-6, msg=lambda m, cfg=cfg: f"{cfg}: {m}")
    times = interleaved_graph_ms(graphs, rounds, replays)
    for cfg, t in zip(configs, times):
        print(f"prefill T{T} k{k} {json.dumps(cfg)}: {1e3 * statistics.median(t):.1f} us, first/this "
              f"{ratio_text(times[0], t)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--extra", default="[]", help="JSON list of more configurations to time beside the shipped ones")
    ap.add_argument("--kinds", default="indexer-like,normal")
    ap.add_argument("--cases", default="", help="comma list of ROWSxCOLUMNS (default: the generation-step cases)")
    ap.add_argument("--configs", default="", help="JSON list of configurations to time instead of the shipped ones "
                    "(then --extra); each is completed from the default one")
    ap.add_argument("--prefill", default="", help="comma list of T: a causal prefill's indexer scores instead, the "
                    "configuration picked for them first, then --extra")
    ap.add_argument("--lse", action="store_true", help="with --prefill: the programs that write the lse too")
    args = ap.parse_args()
    if args.prefill:
        for T in (int(t) for t in args.prefill.split(",")):
            extra = [{**c, "lse": True} if args.lse else c for c in json.loads(args.extra)]
            prefill(T, args.k, [TK.config_for_rows(T, T, lse=args.lse)] + extra, lse=args.lse)
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    shipped = [c for c in TK.SHIPPED_CONFIGS if not c.get("lse")]
    if args.configs:
        shipped = [{**TK.DEFAULT_CONFIG, **c} for c in json.loads(args.configs)]
    configs = shipped + json.loads(args.extra)
    cases = [tuple(int(n) for n in c.split("x")) for c in args.cases.split(",")] if args.cases else CASES
    build_in_parallel(configs + [TK.config_for_rows(r, c) for r, c in cases])
    print("| scores | rows | columns | " + " | ".join(f"{c['threads']}t agg={c.get('agg')}" + (f" parts={c['parts']}" if c.get('parts') else "")
                                           for c in configs)
          + " | picked |")
    print("|" + "---|" * (len(configs) + 4))
    for kind in args.kinds.split(","):
        for rows, cols in cases:
            x = scores(kind, rows, cols, g)
            starts = torch.zeros(rows, dtype=torch.int32, device="cuda")
            ends = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
            times, ref = [], None
            for cfg in configs:
                out = torch.empty(rows, args.k, dtype=torch.int32, device="cuda")
                fn = lambda: TK.topk_rows_ranges(x, starts, ends, args.k, out=out, config=cfg)  # noqa: E731
                graph = capture_graph(fn)
                times.append(1e3 * graph_replay_ms(graph, 50))
                got = out.clone()  # rows come in ascending column order: compared as they are
                ref = got if ref is None else ref
                assert torch.equal(got, ref), (kind, rows, cols, cfg)
            pick = TK.config_for_rows(rows, cols)
            picked = configs.index(pick) if pick in configs else json.dumps(pick)
            print(f"| {kind} | {rows} | {cols} | " + " | ".join(f"{t:.1f}" for t in times)
                  + f" | {picked} |", flush=True)


if __name__ == "__main__":
    main()
