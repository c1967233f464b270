"""Where the dense warm-up indexer loss spends its time: torch.profiler kernel table of one call.

    python benchmarks/kernels/profile_dense_loss.py [--t 8192] [--lse]

Inputs as ``benchmarks/peers/bench_cudnn_indexer.py`` (causal, H 64, Dqk 576, Hi 64, Di 128).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--lse", action="store_true", help="give the dense attention LSE")
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--phases", action="store_true", help="also time each phase of the kernel route (CUDA events)")
    args = ap.parse_args(argv)
    from bench_cudnn_indexer import DQK, _loss_tensors, dense_attn_lse
    from dsa_plugins.ops import causal_key_windows, indexer_kl_loss

    t = args.t
    scale = DQK ** -0.5
    q, kv, iq, ik, w = _loss_tensors(t, torch.Generator(device="cuda").manual_seed(0))
    ks, ke = causal_key_windows(torch.tensor([0, t], device="cuda"), num_tokens=t)
    lse = dense_attn_lse(q, kv, scale) if args.lse else None

    def run():
        leaves = [x.detach().requires_grad_() for x in (iq, ik, w)]
        loss = indexer_kl_loss(*leaves, q, kv, lse, scale, key_start=ks, key_end=ke, backend="tilelang")
        return torch.autograd.grad(loss, leaves)

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        run()
    stop.record()
    torch.cuda.synchronize()
    print(f"T {t} attn_lse {'given' if args.lse else 'recomputed'}: {start.elapsed_time(stop) / 5:.2f} ms per call "
          f"(value + gradients), peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.phases:
        phases(iq, ik, w, q, kv, lse, ks, ke, scale)
    return 0


def phases(iq, ik, w, q, kv, lse, ks, ke, scale):
    """ms of each phase of indexer_kl_loss_dense, summed over its row chunks (the calls it makes, timed)."""
    from collections import defaultdict

    from dsa_plugins.kernels import indexer as K
    from dsa_plugins.kernels import indexer_loss as L

    times = defaultdict(float)

    def timed(name, fn):
        def run(*a, **k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            out = fn(*a, **k)
            e1.record()
            torch.cuda.synchronize()
            times[name] += e0.elapsed_time(e1)
            return out
        return run

    saved = (K._Plan.chunk_scores, L._dense_target, L._dense_chunk_terms, L._dense_chunk_grads,
             K.build_score_grads, L.build_dense_terms)
    build_grads, build_terms = K.build_score_grads, L.build_dense_terms
    K.build_score_grads = lambda side, *a, **k: timed(f"grads {side}-major", build_grads(side, *a, **k))
    L.build_dense_terms = lambda *a, **k: timed("row terms", build_terms(*a, **k))
    entries = L.key_block_entries
    L.key_block_entries = timed("key-major list", entries)
    K._Plan.chunk_scores = timed("scores", K._Plan.chunk_scores)
    L._dense_target = timed("attention target", L._dense_target)
    L._dense_chunk_terms = timed("target + row terms", L._dense_chunk_terms)
    L._dense_chunk_grads = timed("gradient programs", L._dense_chunk_grads)
    try:
        for rep in range(2):
            times.clear()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            L.indexer_kl_loss_dense(iq, ik, w, q, kv, lse, ks, ke, scale,
                                    grad_rows=torch.full((iq.shape[0],), 1.0 / iq.shape[0], device=iq.device))
            e1.record()
            torch.cuda.synchronize()
        total = e0.elapsed_time(e1)
        print(f"phases (synchronised after each, so the sum exceeds a plain call): total {total:.2f} ms; "
              + ", ".join(f"{k} {v:.2f}" for k, v in times.items()), flush=True)
    finally:
        (K._Plan.chunk_scores, L._dense_target, L._dense_chunk_terms, L._dense_chunk_grads, K.build_score_grads,
         L.build_dense_terms) = saved
        L.key_block_entries = entries


if __name__ == "__main__":
    raise SystemExit(main())
