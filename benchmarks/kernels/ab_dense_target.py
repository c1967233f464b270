"""The dense loss's attention target alone (one causal sequence, the normaliser given): tilings of its program
compiled side by side, checked against the first and timed (triton do_bench median, L2 flushed), and one more
launch of each for Nsight Compute:

    python benchmarks/kernels/ab_dense_target.py [--t 8192] [--heads 64] [--dim 576] [--variants JSON]
    ncu --kernel-name main_kernel --launch-skip 3 --launch-count 1 python benchmarks/kernels/ab_dense_target.py

Variants: a JSON list of {"chunk": columns per pipeline step, "num_stages": int}; default: the shipped tiling
alone. TFLOP/s count 2 * heads * dim per causal (row, key) pair: the MMAs on the keys a row sees."""
import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import torch

from dsa_plugins.bench.runner import median_ms
from dsa_plugins.kernels import indexer as K
from dsa_plugins.kernels import indexer_loss as L


def compile_variant(v, heads, dim, block_q, block_k):
    import tilelang

    prog = L._dense_target_program(heads, dim, block_q, block_k, **v)
    return tilelang.compile(prog, target="auto", pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
                            compile_flags=["-O3", "-DNDEBUG"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--variants", default="[{}]")
    args = ap.parse_args(argv)
    t, h, d = args.t, args.heads, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    norm2 = torch.full((t, h), 8.0 * 1.4426950408889634, device="cuda")
    rows = torch.arange(t, device="cuda", dtype=torch.int32)
    plan = K._Plan(torch.zeros(t, 64, 128, device="cuda", dtype=torch.bfloat16),
                   torch.zeros(t, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(t, 64, device="cuda"),
                   torch.zeros_like(rows), rows + 1, None, 1 << 62)
    (chunk,) = plan.chunks
    width = chunk[2] * plan.bk
    variants = json.loads(args.variants)
    with ThreadPoolExecutor(len(variants)) as ex:
        kernels = list(ex.map(lambda v: compile_variant(v, h, d, plan.bq, plan.bk), variants))
    flops = 2 * h * d * t * (t + 1) / 2
    first = None
    for v, kern in zip(variants, kernels):
        P = torch.empty(t, width, device="cuda")

        def run():
            kern(q.view(t * h, d), kv, norm2, plan.blk_lo, plan.blk_hi, d ** -0.5 * 1.4426950408889634, P)

        run()
        inside = torch.arange(width, device="cuda")[None, :] <= rows[:, None]
        got = P[inside]
        diff = 0.0 if first is None else (got - first).abs().max().item()
        first = got if first is None else first
        ms = median_ms(run)
        print(f"dense target T {t} H {h} Dqk {d} {v}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s, "
              f"max diff vs first {diff:.2e}", flush=True)
        run()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
