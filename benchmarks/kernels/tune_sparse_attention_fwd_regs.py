"""Register budgets of the forward kernel: time candidates on the headline shapes and check each
against the default's output. `python benchmarks/kernels/tune_sparse_attention_fwd_regs.py` (GPU)."""

import concurrent.futures as cf
import multiprocessing as mp

import torch

from dsa_plugins.bench.runner import median_ms
from dsa_plugins.kernels import sparse_attention_fwd as F

CANDIDATES = [
    {},  # the default (56 / 224, 224)
    {"producer_regs": 48, "consumer_regs": (256, 200)},
    {"producer_regs": 40, "consumer_regs": (240, 224)},
    {"producer_regs": 48, "consumer_regs": (232, 224)},
]
SHAPES = [  # name, S, Skv, H, Dqk, Dv, K, sink
    ("mla_h128", 4096, 8192, 128, 576, 512, 2048, False),
    ("v4_sink_h128", 4096, 8192, 128, 512, 512, 1024, True),
]


def _compile(args):
    dqk, dv, sink, over = args
    cfg = F.config_for(dqk, dv, sink, torch.bfloat16, over)
    F.build_fwd_kernel(cfg, target={"kind": "cuda", "arch": "sm_90a"})
    return over


def main():
    jobs = [(s[4], s[5], s[7], c) for s in SHAPES for c in CANDIDATES]
    with cf.ProcessPoolExecutor(8, mp_context=mp.get_context("spawn")) as ex:
        for fut in cf.as_completed([ex.submit(_compile, j) for j in jobs]):
            try:
                fut.result()
            except Exception as exc:
                print("compile failed:", repr(exc)[:300])
    for name, s, skv, h, dqk, dv, k, sink in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, s, h, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(1, skv, dqk, device="cuda", dtype=torch.bfloat16, generator=g)
        idx = torch.randint(-1, skv, (1, s, k), device="cuda", dtype=torch.int32, generator=g)
        z = torch.randn(h, device="cuda", generator=g) if sink else None
        flops = 2.0 * s * h * k * (dqk + dv)
        ref = None
        for over in CANDIDATES:
            out = torch.empty(1, s, h, dv, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(1, s, h, device="cuda")
            try:
                run = lambda: F._launch(q, kv, idx, dqk ** -0.5, z, dv, out, lse, over)  # noqa: E731
                run()
                torch.cuda.synchronize()
            except Exception as exc:
                print(f"{name} {over}: failed {exc!r}"[:300])
                continue
            if ref is None:
                ref = (out.clone(), lse.clone())
            same = torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
            diff = (out.float() - ref[0].float()).abs().max().item()
            ms = median_ms(run)
            print(f"{name:14s} {str(over):55s} {ms:7.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  bitwise-equal={same} maxdiff={diff:.2e}")


if __name__ == "__main__":
    main()
