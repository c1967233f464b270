"""Scratch driver: timings of the TileLang indexer top-k and radix top-k on one GPU.

    python benchmarks/kernels/bench_indexer.py [--out DIR] [--quick] [--sweep] [--fp8]
    python benchmarks/kernels/bench_indexer.py --variants '[{"relu_max": false}]' [--rounds 2]

--variants times each compile-time override of the shipped configuration beside the default in turn (T 8K and
32K, Hi 64 and 32, Di 128, bf16 and fp8), ``--rounds`` times, with the sets checked against the default's.

--fp8 adds the fp8 (e4m3, per-key scales) indexer at the same shapes, and with --sweep its
candidate configurations.

Prints one line per measurement and appends rows to DIR/bench_indexer.csv.
FLOPs of the indexer: 2 * Hi * Di per valid (causal) query-key pair, top-k time included.
"""

import argparse
import csv
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from dsa_plugins.bench.runner import median_ms  # noqa: E402
from dsa_plugins.kernels import indexer as K  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402


def bench(fn, warmup=3, rep=10):
    return median_ms(fn)

ROWS = []


def report(**row):
    ROWS.append(row)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def inputs(T, hi, di, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, hi, di, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, di, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, hi, device="cuda", generator=g) * (hi**-0.5 * di**-0.5)
    ar = torch.arange(T, device="cuda", dtype=torch.int32)
    return q, k, w, torch.zeros_like(ar), ar + 1


def bench_topk():
    torch.manual_seed(0)
    x = torch.randn(64, 32768, device="cuda")
    ref = torch.topk(x, 2048, dim=1).values
    tr = bench(lambda: torch.topk(x, 2048, dim=1))
    base = torch.arange(32768, device="cuda", dtype=torch.int32) + (127 << 23)
    xc = torch.stack([base[torch.randperm(32768, device="cuda")] for _ in range(64)]).view(torch.float32)
    for cfg in [None] + list(TK.SHIPPED_CONFIGS):
        out = TK.topk_rows(x, None, 2048, config=cfg)
        got = torch.sort(x.gather(1, out.long()), dim=1, descending=True).values
        exact = bool(torch.equal(got, ref))
        t = bench(lambda: TK.topk_rows(x, None, 2048, config=cfg))
        t2 = bench(lambda: TK.topk_rows(xc, None, 2048, config=cfg))
        report(case="radix_topk", shape="64x32768", k=2048, ms=t, torch_topk_ms=tr, exact=exact,
               clustered_ms=t2, cfg=str(cfg or "default"))


def bench_indexer(T, hi, di, k, config=None, split=True, topk_sweep=False, fp8=False):
    q, kk, w, ks, ke = inputs(T, hi, di)
    k_scale = None
    if fp8:
        from dsa_plugins.ops import quantize_indexer_fp8

        q, kk, k_scale, w = quantize_indexer_fp8(q, kk, w)
    pairs = T * (T + 1) / 2
    flops = 2.0 * hi * di * pairs
    fn = lambda: K.indexer_topk(q, kk, w, ks, ke, k, config=config, index_k_scale=k_scale)  # noqa: E731
    out_c = fn()
    torch.cuda.synchronize()
    t = bench(fn)
    row = dict(case="indexer_topk_fp8" if fp8 else "indexer_topk", T=T, hi=hi, di=di, k=k, ms=t,
               tflops=flops / t / 1e9, cfg=str(config or K.default_config(hi, di, fp8)))
    if config is not None:
        # same sets as the default configuration (the GPU tests verify the default)?
        ref = K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale)
        same = (torch.sort(out_c, 1).values == torch.sort(ref, 1).values).all(1).float().mean().item()
        row["same_sets_as_default"] = same
    del out_c
    if split:
        plan = K._Plan(q, kk, w, ks, ke, config, K.DEFAULT_MAX_CHUNK_BYTES, k_scale)

        def scores_only():
            for c in plan.chunks:
                plan.chunk_scores(c)

        ts = bench(scores_only)
        row.update(scores_ms=ts, scores_tflops=flops / ts / 1e9, chunks=len(plan.chunks))
        try:
            bufs = [plan.chunk_scores(c) for c in plan.chunks]
            out = torch.empty(T, k, dtype=torch.int32, device="cuda")

            def topk_only():
                for r0, r1, s in bufs:
                    plan.chunk_topk(r0, r1, s, k, out)

            tt = bench(topk_only)
            row.update(topk_ms=tt, topk_share=tt / t)
            if topk_sweep:
                for i, tc in enumerate(TK.SHIPPED_CONFIGS):
                    def topk_cfg(tc=tc):
                        for r0, r1, s in bufs:
                            plan.chunk_topk(r0, r1, s, k, out, config=tc)

                    row[f"topk_ms_cfg{i}"] = bench(topk_cfg)
            del bufs
        except torch.cuda.OutOfMemoryError:
            row.update(topk_share_est=(t - ts) / t)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    row["peak_gib"] = peak
    report(**row)


HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # nominal (SXM)


def _hbm_bandwidth() -> float:
    name = torch.cuda.get_device_name()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in name), float("nan"))


def decode_inputs(batch, context, hi, di, fp8=False, seed=1):
    """A generation step's indexer inputs: one query row per sequence over its own ``context`` keys (packed), fp8
    quantised as the fp8 index cache does. Returns (q, k, weights, k_scale or None, key_start, key_end)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, hi, di, device="cuda", generator=g).bfloat16()
    kk = torch.randn(batch * context, di, device="cuda", generator=g).bfloat16()
    w = torch.randn(batch, hi, device="cuda", generator=g) * (hi**-0.5 * di**-0.5)
    k_scale = None
    if fp8:
        from dsa_plugins.ops import quantize_indexer_fp8

        q, kk, k_scale, w = quantize_indexer_fp8(q, kk, w)
    ks = (torch.arange(batch, device="cuda", dtype=torch.int32) * context).contiguous()
    return q, kk, w, k_scale, ks, ks + context


def bench_decode(batch, context, hi, di, k, fp8=False):
    """Generation step: one query row per sequence over its whole cache (packed keys, batched layout
    declared), top-k included. ``ms``: the shipped plan (one row per CTA, each row's buffer spans its
    own cache, no host sync); ``graph_ms``: the same call replayed from a CUDA graph (no host time);
    ``ms_prefill_tiling``: the prefill tiling without the layout (4 rows of 4 sequences per CTA, a
    buffer over their union: the plan before). Bandwidth: index_k bytes read / graph time."""
    q, kk, w, k_scale, ks, ke = decode_inputs(batch, context, hi, di, fp8)
    fn = lambda: K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale, entries=(1, context))  # noqa: E731
    out = fn()
    t = bench(fn)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    tg = bench(graph.replay)
    old = lambda: K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale,  # noqa: E731
                                 config=K.default_config(hi, di, fp8))
    out_old = old()
    t_old = bench(old)
    same = (torch.sort(out, 1).values == torch.sort(out_old, 1).values).all(1).float().mean().item()
    key_bytes = batch * context * (di * kk.element_size() + (4 if fp8 else 0))
    report(case="indexer_decode_fp8" if fp8 else "indexer_decode", B=batch, context=context, hi=hi, k=k, ms=t,
           graph_ms=tg, ms_prefill_tiling=t_old, speedup=t_old / t, hbm_fraction=key_bytes / (tg * 1e-3) /
           _hbm_bandwidth(), same_sets=same)
    del graph


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--decode", action="store_true", help="only the generation-step (decode) cases")
    ap.add_argument("--variants", default=None, help="JSON list of overrides of the shipped configuration")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print("GPU:", torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)

    sweep = [
        {"heads": 64, "dim": 128, "block_q": 2, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True},
        {"heads": 64, "dim": 128, "block_q": 4, "block_k": 128, "threads": 256, "num_stages": 3, "ws": True},
        {"heads": 64, "dim": 128, "block_q": 8, "block_k": 64, "threads": 256, "num_stages": 2, "ws": True,
         "split_n": True},
        {"heads": 64, "dim": 128, "block_q": 8, "block_k": 64, "threads": 256, "num_stages": 3, "ws": True,
         "split_n": True},
        {"heads": 32, "dim": 128, "block_q": 8, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True},
        {"heads": 32, "dim": 128, "block_q": 16, "block_k": 64, "threads": 256, "num_stages": 2, "ws": True,
         "split_n": True},
    ]
    fp8_base = {"heads": 64, "dim": 128, "num_stages": 2, "ws": True, "fp8": True, "block_k": 128, "threads": 256}
    fp8_sweep = [
        {**fp8_base, "block_q": 4},
        {**fp8_base, "block_q": 4, "num_stages": 3},
        {**fp8_base, "block_q": 4, "split_n": True},
        {**fp8_base, "block_q": 8, "split_n": True},
        {**fp8_base, "block_q": 4, "block_k": 256, "split_n": True},
        {**fp8_base, "heads": 32, "block_q": 8},
        {**fp8_base, "heads": 32, "block_q": 8, "split_n": True},
        {**fp8_base, "heads": 32, "block_q": 4},
    ]
    if not (args.sweep and args.fp8):
        fp8_sweep = []
    if args.variants:
        cases = [(8192, 64, False), (8192, 32, False), (32768, 64, False), (8192, 64, True)]
        variants = [{}] + json.loads(args.variants)
        with ThreadPoolExecutor(8) as ex:  # compile every program first, side by side
            for f in [ex.submit(K.build_indexer, {**K.default_config(h, 128, f8), **v})
                      for _, h, f8 in cases for v in variants]:
                f.result()
        for T_, hi_, f8 in cases:
            for _ in range(args.rounds):
                for v in variants:
                    bench_indexer(T_, hi_, 128, 2048, config={**K.default_config(hi_, 128, f8), **v} if v else None,
                                  fp8=f8)
        return
    t0 = time.time()
    cfgs = list(K.SHIPPED_CONFIGS) + (sweep if args.sweep and not args.fp8 else []) + fp8_sweep
    with ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(K.build_indexer, c) for c in cfgs] + [ex.submit(TK.build_topk, c) for c in TK.SHIPPED_CONFIGS] + [ex.submit(TK.build_tie_fill)]
        for f in futs:
            try:
                f.result()
            except Exception as e:  # a sweep config that does not compile is reported, not fatal
                print("compile failed:", repr(e)[:300], flush=True)
    print(f"compiled {len(futs)} kernels in {time.time() - t0:.1f}s", flush=True)
    if args.compile_only:
        return

    if args.decode:
        for b in (1, 8, 32, 64, 128):
            for ctx in (32768, 131072):
                for fp8 in (False, True):
                    bench_decode(b, ctx, 64, 128, 2048, fp8=fp8)
        return
    if args.fp8:
        for c in fp8_sweep:
            try:
                bench_indexer(8192, c["heads"], 128, 2048, config=c, split=False, fp8=True)
            except Exception as e:
                print("fp8 sweep config failed:", c, repr(e)[:300], flush=True)
        for T_, hi_ in ((8192, 64), (8192, 32)) + (() if args.quick else ((32768, 64), (65536, 64))):
            bench_indexer(T_, hi_, 128, 2048, fp8=True)
    bench_topk()
    bench_indexer(8192, 64, 128, 2048, topk_sweep=True)
    if args.sweep and not args.fp8:
        for c in sweep:
            try:
                bench_indexer(8192, c["heads"], c["dim"], 2048, config=c, split=False)
            except Exception as e:
                print("sweep config failed:", c, repr(e)[:300], flush=True)
    bench_indexer(8192, 32, 128, 2048)
    if not args.quick:
        bench_indexer(32768, 64, 128, 2048, topk_sweep=True)
        bench_indexer(65536, 64, 128, 2048, topk_sweep=True)

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_indexer.csv")
    keys = sorted({k for r in ROWS for k in r})
    with open(path, "a", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        if f.tell() == 0:
            wr.writeheader()
        for r in ROWS:
            wr.writerow(r)
    print("wrote", path)


if __name__ == "__main__":
    main()
