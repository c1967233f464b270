"""The shipped top-k beside an earlier top-k module (what the canonical order cost, against 06a3055, whose rows
came in the order its atomics gave; what a change of the programs' shapes gains), same inputs, each case from a
CUDA graph (the indexer cases, which plan on the host: median_ms of eager calls), timed in alternating rounds; the
sets checked equal, the shipped rows in ascending column order.

    git show 06a3055:dsa_plugins/kernels/topk.py > /tmp/topk_before.py
    python benchmarks/kernels/ab_topk_order.py --baseline /tmp/topk_before.py [--rounds 7] [--indexer 8192,32768]
        [--lse]

Cases: top-k alone over random rows (generation steps: 1 / 32 / 64 long rows; prefill-like: thousands of rows),
and the causal indexer + top-k (Hi 64, Di 128, k 2048, bf16) at the given lengths, as issue 14 measures it
(``--lse``: also with the selected scores' logsumexp, as the indexer loss's training step asks for it).
"""

import argparse
import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_indexer import inputs  # noqa: E402
from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, median_ms, ratio_text  # noqa: E402
from dsa_plugins.kernels import indexer as K  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402


def _load_baseline(path: str):
    """The module at ``path`` as a sibling of dsa_plugins.kernels.topk (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("dsa_plugins.kernels.topk_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_topk(module, fn):
    """fn() with the indexer calling ``module``'s top-k."""
    shipped = K._topk
    K._topk = module
    try:
        return fn()
    finally:
        K._topk = shipped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="an earlier dsa_plugins/kernels/topk.py")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--indexer", default="8192,32768", help="causal lengths of the indexer + top-k cases")
    ap.add_argument("--lse", action="store_true", help="the indexer cases with return_lse=True too")
    args = ap.parse_args()
    before = _load_baseline(args.baseline)
    k = 2048
    cases = []
    for rows, n in ((1, 131072), (32, 131072), (64, 65536), (8, 32768), (8192, 8192), (2048, 32768), (1, 300000)):
        g = torch.Generator(device="cuda").manual_seed(rows + n)
        x = torch.randn(rows, n, device="cuda", generator=g)
        cases.append((f"topk_rows R{rows} N{n}", True, lambda m, x=x: m.topk_rows(x, None, k)))
    for t in (int(v) for v in args.indexer.split(",") if v):
        q, kk, w, ks, ke = inputs(t, 64, 128)
        cases.append((f"indexer_topk causal T{t} Hi64", False, lambda m, q=q, kk=kk, w=w, ks=ks, ke=ke:
                      _with_topk(m, lambda: K.indexer_topk(q, kk, w, ks, ke, k))))
        if args.lse:
            cases.append((f"indexer_topk lse causal T{t} Hi64", False, lambda m, q=q, kk=kk, w=w, ks=ks, ke=ke:
                          _with_topk(m, lambda: K.indexer_topk(q, kk, w, ks, ke, k, return_lse=True)[0])))
    for name, graphed, fn in cases:
        new, old = fn(TK), fn(before)
        assert torch.equal(new.sort(1).values, old.sort(1).values), name
        valid = new >= 0
        assert bool(((new[:, 1:] > new[:, :-1]) | ~valid[:, 1:]).all()), name
        if graphed:
            times = interleaved_graph_ms([capture_graph(lambda: fn(TK)), capture_graph(lambda: fn(before))],
                                         args.rounds, 10)
        else:
            times = [[], []]
            for r in range(args.rounds):
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    times[i].append(median_ms(lambda: fn((TK, before)[i])))
        t_new, t_old = times
        new_us, old_us = statistics.median(t_new) * 1e3, statistics.median(t_old) * 1e3
        print(f"{name:<34} shipped {new_us:9.1f} us  baseline {old_us:9.1f} us  shipped / baseline time "
              f"{ratio_text(t_new, t_old)}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
