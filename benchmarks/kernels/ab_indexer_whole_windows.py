"""The indexer top-k with and without scoring the rows that select their whole window, in alternating rounds.

    python benchmarks/kernels/ab_indexer_whole_windows.py [--T 2048,4096,8192,32768] [--rounds 7] [--k 2048]
        [--decode 32x2048,32x32768]

A row whose window holds at most k keys selects all of them, so ``indexer_topk`` leaves a query block of such
rows unscored (a causal prefill's first k rows; every row of a generation step over a cache of at most k keys);
``score_whole_windows=True`` scores them as before. Both calls on the same inputs (one causal sequence of T
tokens, Hi 64, Di 128; ``--decode BxC``: B rows over caches of C keys, the batched layout), rows checked equal
bit for bit, then timed call after call with CUDA events in alternating rounds (eager: the T 32K call plans its
chunks with a host sync). Prints per case the median ms of each and the ratio scored / unscored per round
(> 1: leaving them unscored is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_indexer import inputs as causal_inputs  # noqa: E402  (one causal sequence: q, k, w, windows)
from dsa_plugins.bench.runner import interleaved_calls_ms, ratio_text  # noqa: E402
from dsa_plugins.kernels import indexer as K  # noqa: E402


def ab(name: str, unscored, scored, rounds: int) -> None:
    if not torch.equal(unscored(), scored()):
        raise SystemExit(f"{name}: the rows differ")
    a, b = interleaved_calls_ms([unscored, scored], rounds)
    print(f"{name:28s} unscored {statistics.median(a):8.3f} ms  scored {statistics.median(b):8.3f} ms  "
          f"scored / unscored {ratio_text(b, a)}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="2048,4096,8192,32768")
    ap.add_argument("--decode", default="32x2048,32x32768", help="generation steps BxC ('' for none)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    print(torch.cuda.get_device_name(), flush=True)
    k = args.k
    for t in (int(v) for v in args.T.split(",") if v):
        q, kk, w, ks, ke = causal_inputs(t, 64, 128)
        ab(f"prefill T {t} k {k}", lambda: K.indexer_topk(q, kk, w, ks, ke, k),
           lambda: K.indexer_topk(q, kk, w, ks, ke, k, score_whole_windows=True), args.rounds)
        del q, kk, w
        torch.cuda.empty_cache()
    for case in (v for v in args.decode.split(",") if v):
        b, c = (int(x) for x in case.split("x"))
        g = torch.Generator(device="cuda").manual_seed(b)
        q = torch.randn(b, 64, 128, device="cuda", generator=g).bfloat16()
        kk = torch.randn(b * c, 128, device="cuda", generator=g).bfloat16()
        w = torch.randn(b, 64, device="cuda", generator=g) * (64**-0.5 * 128**-0.5)
        zero = torch.zeros(b, dtype=torch.int32, device="cuda")
        end = torch.full_like(zero, c)
        kw = dict(entries=(1, c), entry_windows=True)
        ab(f"generation step B {b} x {c}", lambda: K.indexer_topk(q, kk, w, zero, end, k, **kw),
           lambda: K.indexer_topk(q, kk, w, zero, end, k, score_whole_windows=True, **kw), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
