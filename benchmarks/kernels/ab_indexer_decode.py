"""A/B of the generation-step indexer's score program: key-range splits per row and tile configurations, the
scores alone, each from a CUDA graph, timed in alternating rounds; every variant's scores checked equal.

    python benchmarks/kernels/ab_indexer_decode.py --batch 32 --context 131072 --heads 32 --fp8 \\
        --splits 8,16,17 --configs '[{}, {"num_stages": 4}]'

A variant is (splits, configuration): splits 0 is the shipped rule (``indexer._splits``), N/sm at most N CTAs per
SM (N x SMs // B); a configuration is laid over the shipped decode one. Bandwidth: the key bytes (B x context x Di, x 2 for bf16, + 4-byte scales for fp8)
over the median time.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_indexer import decode_inputs  # noqa: E402
from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, ratio_text  # noqa: E402
from dsa_plugins.kernels import indexer as K  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--splits", default="0", help="comma list: 0 (the shipped rule), a count, or N/sm (N CTAs per SM "
                    "at most: N * SMs // B)")
    ap.add_argument("--configs", default="[{}]", help="JSON list of overrides of the shipped decode configuration")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    B, ctx, hi, di = args.batch, args.context, args.heads, 128
    q, kk, w, k_scale, ks, ke = decode_inputs(B, ctx, hi, di, args.fp8)
    base = K.default_config(hi, di, args.fp8, rows=B)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counts = [max(1, int(s[:-3]) * sms // B) if s.endswith("/sm") else int(s) for s in args.splits.split(",")]
    variants = [(n, {**base, **c}) for c in json.loads(args.configs) for n in counts]
    shipped_splits = K._splits
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(variants)) as pool:  # compile in parallel (nvcc runs outside the GIL)
        list(pool.map(K.build_indexer, [json.loads(c) for c in {json.dumps(cfg, sort_keys=True) for _s, cfg in variants}]))
    graphs, bufs = [], []
    for splits, cfg in variants:
        plan = K._Plan(q, kk, w, ks, ke, cfg, K.DEFAULT_MAX_CHUNK_BYTES, k_scale, (1, ctx))
        assert len(plan.chunks) == 1
        K._splits = (lambda *a, **kw: splits) if splits else shipped_splits
        try:
            r0, r1, buf = plan.chunk_scores(plan.chunks[0])
            graphs.append(capture_graph(lambda plan=plan, buf=buf: plan.chunk_scores(plan.chunks[0], scores=buf)))
        finally:
            K._splits = shipped_splits
        bufs.append(buf)
    for (splits, cfg), buf in zip(variants, bufs):
        # the columns of each row's keys (the buffer may be a block wider: windows need not start on a block)
        # (another tile shape may sum a score's heads in another order: close, not always the same bits)
        torch.testing.assert_close(buf[:, :ctx], bufs[0][:, :ctx], rtol=1e-5, atol=1e-6, msg=str((splits, cfg)))
    # the first variant against a float32 recomputation of rows 0 and B - 1 (every key of their windows)
    for b in (0, B - 1):
        keys = kk[b * ctx : (b + 1) * ctx].float()
        ref = (keys @ q[b].float().T).relu() @ w[b].float()
        if k_scale is not None:
            ref = ref * k_scale[b * ctx : (b + 1) * ctx]
        torch.testing.assert_close(bufs[0][b, :ctx], ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    # the whole op (scores + top-k) as the models call it (the batched layout declared: no host sync, so it
    # captures at every size), beside the scores alone
    graphs.append(capture_graph(lambda: K.indexer_topk(q, kk, w, ks, ke, 2048, index_k_scale=k_scale,
                                                       entries=(1, ctx))))
    variants.append((0, {"op": "indexer_topk entries=(1, ctx)"}))
    times = interleaved_graph_ms(graphs, args.rounds, 20)
    nbytes = B * ctx * (di * (1 if args.fp8 else 2) + (4 if args.fp8 else 0))
    shipped = shipped_splits(B, ctx // base["block_k"], torch.device("cuda"), one_row_blocks=True)
    print(f"B {B} context {ctx} Hi {hi}{' fp8' if args.fp8 else ' bf16'}: shipped splits {shipped}, "
          f"{torch.cuda.get_device_name()}")
    for (splits, cfg), t in zip(variants, times):
        us = 1e3 * statistics.median(t)
        over = {k: v for k, v in cfg.items() if base.get(k) != v} if "op" not in cfg else cfg
        print(f"  splits {splits or shipped:>3} {json.dumps(over)}: {us:7.1f} us, {nbytes / us / 1e6:5.2f} TB/s, "
              f"first/this {ratio_text(times[0], t)}", flush=True)


if __name__ == "__main__":
    main()
