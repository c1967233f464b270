"""The dense loss's attention target alone (one causal sequence, the normaliser given), timed, and one more
launch for Nsight Compute:

    python benchmarks/kernels/ncu_dense_target.py [--t 8192] [--heads 64] [--dim 576]
    ncu --kernel-name main_kernel --launch-skip 3 --launch-count 1 python benchmarks/kernels/ncu_dense_target.py

TFLOP/s count 2 * heads * dim per causal (row, key) pair: the target's MMAs on the keys rows see."""
import argparse

import torch

from dsa_plugins.kernels import indexer as K
from dsa_plugins.kernels import indexer_loss as L


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=576)
    args = ap.parse_args(argv)
    t, h, d = args.t, args.heads, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lse = torch.full((t, h), 8.0, device="cuda")
    rows = torch.arange(t, device="cuda", dtype=torch.int32)
    iq = torch.zeros(t, 64, 128, device="cuda", dtype=torch.bfloat16)
    plan = K._Plan(iq, torch.zeros(t, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(t, 64, device="cuda"),
                   torch.zeros_like(rows), rows + 1, None, 1 << 62)
    (chunk,) = plan.chunks
    width = chunk[2] * plan.bk

    def run():
        return L._dense_target(plan, chunk, q, kv, lse, None, d ** -0.5, width)

    for _ in range(2):
        run()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        run()
    e1.record()
    torch.cuda.synchronize()
    ms = e0.elapsed_time(e1) / 5
    flops = 2 * h * d * t * (t + 1) / 2
    print(f"dense target T {t} H {h} Dqk {d}: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
    run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
