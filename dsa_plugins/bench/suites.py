"""Benchmark suites: the shape tables of ``python -m dsa_plugins bench``.

``python -m dsa_plugins bench --suite attention|indexer|smoke|all [--providers tilelang,torch,sdpa]``
times every op of a suite with :mod:`.runner` and writes ``benchmarks/results/<suite>.{csv,md,png}``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from .runner import Case, run_cases, write_results

# Anchor figures from DSA.md section 5 (H200, TileLang 0.1.15 examples): TFLOP/s, or ms for top-k.
ANCHORS = {
    ("sparse_mla", "fwd", "B1 S4096 Skv8192 H128 D576/512 k2048"): ("tflops", 548.6),
    ("sparse_mla", "bwd", "B1 S4096 Skv8192 H64 D576/512 k2048"): ("tflops", 190.2),
    ("sparse_attention_sink", "fwd", "B1 S4096 Skv8192 H128 D512/512 k1024"): ("tflops", 354.3),
    ("topk_rows", "fwd", "R64 N32768 k2048"): ("ms", 0.032),
}



def _attention_case(op, b, s, skv, h, dqk, dv, k, sink, device, dtype, causal_indices=True):
    """Sparse attention (sink=True: DeepSeek-V4 style, else absorbed-MLA latent) at one shape."""
    from ..ops import sparse_attention

    shape = f"B{b} S{s} Skv{skv} H{h} D{dqk}/{dv} k{k}"
    per_q_fwd = 2 * h * k * (dqk + dv)
    per_q_bwd = 2 * h * k * (2 * dv + 3 * dqk)
    el = torch.finfo(dtype).bits // 8
    io = b * s * h * (dqk + dv) * el + b * skv * dqk * el + b * s * k * 4
    flops = {"fwd": b * s * per_q_fwd, "bwd": b * s * per_q_bwd, "full": b * s * (per_q_fwd + per_q_bwd)}
    nbytes = {"fwd": io, "bwd": 2 * io + b * skv * dqk * 4, "full": 3 * io + b * skv * dqk * 4}
    scale = dqk ** -0.5

    def inputs(requires_grad):
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, s, h, dqk, device=device, dtype=dtype, generator=g).requires_grad_(requires_grad)
        kv = torch.randn(b, skv, dqk, device=device, dtype=dtype, generator=g).requires_grad_(requires_grad)
        z = torch.randn(h, device=device, dtype=torch.float32, generator=g).requires_grad_(requires_grad) if sink else None
        if causal_indices:  # each query at position p (aligned to the end of kv) picks k keys among 0..p
            pos = torch.arange(s, device=device) + (skv - s)
            r = torch.rand(b, s, k, device=device, generator=g)
            idx = (r * (pos + 1).view(1, s, 1)).long().clamp_max(skv - 1)
        else:
            idx = torch.randint(0, skv, (b, s, k), device=device, generator=g)
        return q, kv, z, idx.to(torch.int32)

    def make(provider, mode):
        grad = mode != "fwd"
        q, kv, z, idx = inputs(grad)
        if provider in ("tilelang", "torch"):
            run = lambda: sparse_attention(q, kv, idx, scale, sink=z, dv=dv, backend=provider)  # noqa: E731
        elif provider == "sdpa":
            if sink:
                raise NotImplementedError("SDPA has no attention sink")
            qh = q.transpose(1, 2)  # dense causal attention at the same shape: the baseline
            kh = kv.unsqueeze(1).expand(b, h, skv, dqk)
            vh = kv[..., :dv].unsqueeze(1).expand(b, h, skv, dv)
            off = skv - s
            mask = torch.ones(s, skv, dtype=torch.bool, device=device).tril(off)
            run = lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # noqa: E731
        else:
            raise NotImplementedError(provider)
        if mode == "fwd":
            return run
        out = run()
        dout = torch.randn_like(out)
        leaves = [t for t in (q, kv, z) if t is not None]
        if mode == "bwd":
            return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
        return lambda: torch.autograd.grad(run(), leaves, dout)

    return Case(op, shape, flops, nbytes, make, ("fwd", "bwd"), {"sdpa_flops_scale": skv / k})


def _indexer_case(t, hi, di, k, device, dtype, fp8=False):
    """Indexer + top-k over one causal sequence; fp8: e4m3 q/k with per-key scales (inference)."""
    from ..ops import causal_key_windows, indexer_topk, quantize_indexer_fp8

    pairs = t * (t + 1) / 2
    flops = {"fwd": 2 * hi * di * pairs}
    elem = 1 if fp8 else 2
    nbytes = {"fwd": t * hi * di * elem + t * di * elem + t * hi * 4 + t * k * 4}

    def make(provider, mode):
        if provider not in ("tilelang", "torch"):
            raise NotImplementedError(provider)
        g = torch.Generator(device=device).manual_seed(0)
        iq = torch.randn(t, hi, di, device=device, dtype=dtype, generator=g)
        ik = torch.randn(t, di, device=device, dtype=dtype, generator=g)
        w = torch.rand(t, hi, device=device, generator=g) * (hi * di) ** -0.5
        k_scale = None
        if fp8:
            iq, ik, k_scale, w = quantize_indexer_fp8(iq, ik, w)
        start, end = causal_key_windows(torch.tensor([0, t], device=device), num_tokens=t)
        return lambda: indexer_topk(iq, ik, w, k, start, end, backend=provider, index_k_scale=k_scale)

    return Case("indexer_topk_fp8" if fp8 else "indexer_topk", f"T{t} Hi{hi} Di{di} k{k} causal", flops, nbytes,
                make)


def _topk_case(rows, n, k, device):
    from ..ops import topk_rows

    def make(provider, mode):
        x = torch.randn(rows, n, device=device)
        if provider in ("tilelang", "torch"):
            return lambda: topk_rows(x, None, k, backend=provider)
        if provider == "torch.topk":
            return lambda: torch.topk(x, k, dim=-1)
        raise NotImplementedError(provider)

    return Case("topk_rows", f"R{rows} N{n} k{k}", {"fwd": 0.0}, {"fwd": rows * n * 4 + rows * k * 4}, make)


def build_suite(name: str, device: torch.device, dtype=torch.bfloat16) -> list[Case]:
    cases: list[Case] = []
    if name in ("smoke",):
        cases.append(_attention_case("sparse_mla", 1, 64, 128, 16, 64, 48, 32, False, device, dtype))
        cases.append(_attention_case("sparse_attention_sink", 1, 64, 128, 16, 64, 64, 32, True, device, dtype))
        cases.append(_indexer_case(256, 8, 32, 16, device, dtype))  # Hi 8: the smallest the kernel takes
        cases.append(_indexer_case(256, 8, 32, 16, device, dtype, fp8=True))
        cases.append(_topk_case(4, 512, 16, device))
    if name in ("attention", "all"):
        cases.append(_attention_case("sparse_mla", 1, 4096, 8192, 128, 576, 512, 2048, False, device, dtype))
        cases.append(_attention_case("sparse_mla", 1, 4096, 8192, 64, 576, 512, 2048, False, device, dtype))
        cases.append(_attention_case("sparse_attention_sink", 1, 4096, 8192, 128, 512, 512, 1024, True, device, dtype))
        cases.append(_attention_case("sparse_attention_sink", 1, 4096, 8192, 64, 512, 512, 1024, True, device, dtype))
        for skv in (32768, 65536, 131072):
            cases.append(_attention_case("sparse_mla", 1, 4096, skv, 128, 576, 512, 2048, False, device, dtype))
    if name in ("indexer", "all"):
        for t in (8192, 32768, 65536):
            cases.append(_indexer_case(t, 64, 128, 2048, device, dtype))
            cases.append(_indexer_case(t, 64, 128, 2048, device, dtype, fp8=True))
        cases.append(_topk_case(64, 32768, 2048, device))
    if not cases:
        raise ValueError(f"unknown suite {name!r}")
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_plugins bench")
    parser.add_argument("--suite", default=None, help="smoke | attention | indexer | all (default: all on GPU, smoke on CPU)")
    parser.add_argument("--providers", default=None, help="comma list of tilelang,torch,sdpa,torch.topk")
    parser.add_argument("--modes", default=None, help="comma list of fwd,bwd")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=os.environ.get("DSA_PLUGINS_BENCH_OUT", "benchmarks/results"))
    parser.add_argument("--tag", default=None, help="file name stem of the results (default: the suite)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    suite = args.suite or ("all" if device.type == "cuda" else "smoke")
    default_providers = "tilelang,torch,sdpa,torch.topk" if device.type == "cuda" else "torch,sdpa,torch.topk"
    providers = (args.providers or default_providers).split(",")
    reps = args.reps or (30 if device.type == "cuda" else 5)
    cases = build_suite(suite, device, torch.bfloat16)
    rows = run_cases(cases, providers, device, args.modes.split(",") if args.modes else None, reps=reps,
                     anchors=ANCHORS)
    paths = write_results(rows, Path(args.out), args.tag or suite)
    print("wrote", ", ".join(str(p) for p in paths if p))
    return 0
