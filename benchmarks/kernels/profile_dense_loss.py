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
    ap.add_argument("--gaps", action="store_true", help="also list where the GPU idles inside a call (host time)")
    ap.add_argument("--sync-plan", action="store_true",
                    help="plan the row chunks from the windows (a host sync) instead of from the sizes alone")
    args = ap.parse_args(argv)
    from dsa_plugins.bench.runner import median_ms
    from dsa_plugins.kernels import indexer_loss

    indexer_loss.DENSE_SYNC_FREE = not args.sync_plan
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
    peak = torch.cuda.max_memory_allocated() / 2**30  # (before do_bench's L2-flush buffer)
    print(f"T {t} attn_lse {'given' if args.lse else 'recomputed'}"
          f"{', chunks planned from the windows' if args.sync_plan else ''}: {start.elapsed_time(stop) / 5:.2f} ms "
          f"per call (value + gradients; do_bench median {median_ms(run):.2f}), peak {peak:.2f} GiB", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.phases:
        phases(iq, ik, w, q, kv, lse, ks, ke, scale)
    if args.gaps:
        gaps(prof)
    return 0


def gaps(prof, top: int = 12):
    """GPU busy time of the profiled call (the union of its kernels and copies) against its span, and the
    longest idle gaps with the kernels on either side (host time: launches, a host sync)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return
    busy, holes, end, prev = 0.0, [], spans[0][0], spans[0][2]
    for s, e, name in spans:
        if s > end:
            holes.append((s - end, prev, name))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, prev = e, name
    span = end - spans[0][0]
    print(f"GPU busy {busy / 1e3:.2f} of {span / 1e3:.2f} ms ({len(spans)} kernels and copies); idle gaps "
          f"{sum(h[0] for h in holes) / 1e3:.2f} ms, the longest:", flush=True)
    for us, a, b in sorted(holes, reverse=True)[:top]:
        print(f"  {us:8.1f} us  after {a[:60]}  before {b[:60]}")


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
