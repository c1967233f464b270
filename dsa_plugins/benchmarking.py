"""Benchmark runner: times ops over a shape table, writes CSV + markdown + a plot.

``python -m dsa_plugins bench --suite attention|indexer|smoke|all [--providers tilelang,torch,sdpa]``

Each row: op, provider, mode (fwd/bwd/full), shape, median and 20/80% quantiles in ms (CUDA events
on GPU, perf_counter on CPU; many runs after warm-up), TFLOP/s, minimum bytes moved and GB/s,
peak memory, the ratio to the anchor figure of the issue (measured on an H200 with TileLang's
examples) and to the torch reference / dense SDPA rows of the same run, GPU name, versions, git sha.
FLOPs of sparse attention are counted over all k slots (fwd 2*H*k*(Dqk+Dv), bwd 2*H*k*(2*Dv+3*Dqk)
per query), as FlashMLA and TileLang count them.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# Anchor figures from DSA.md section 5 (H200, TileLang 0.1.15 examples): TFLOP/s, or ms for top-k.
ANCHORS = {
    ("sparse_mla", "fwd", "B1 S4096 Skv8192 H128 D576/512 k2048"): ("tflops", 548.6),
    ("sparse_mla", "bwd", "B1 S4096 Skv8192 H64 D576/512 k2048"): ("tflops", 190.2),
    ("sparse_attention_sink", "fwd", "B1 S4096 Skv8192 H128 D512/512 k1024"): ("tflops", 354.3),
    ("topk_rows", "fwd", "R64 N32768 k2048"): ("ms", 0.032),
}


@dataclass
class Case:
    """One op at one shape. ``make(provider, mode)`` returns a zero-argument callable to time, or
    raises NotImplementedError when the provider does not apply."""

    op: str
    shape: str
    flops: dict[str, float]
    bytes: dict[str, float]
    make: Callable[[str, str], Callable[[], object]]
    modes: tuple[str, ...] = ("fwd",)
    meta: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- timing


def time_callable(fn: Callable[[], object], device: torch.device, warmup: int = 5, reps: int = 30, min_time_s: float = 0.0):
    """Median and 20/80% quantiles (ms) and peak memory (GiB) of ``fn``.

    On a GPU, calls under 0.5 s go through triton's do_bench (L2 flushed before each run, many
    runs); slower ones (reference paths, dense baselines at long context) and CPU runs are timed
    call by call (CUDA events / perf_counter) after a short warm-up."""
    for i in range(max(warmup, 1)):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first = time.perf_counter() - t0
        if first > 0.5 and i >= 1:  # slow providers (the reference path, dense baselines): short warm-up
            break
    # and fewer repetitions: about 3 s per row, at least 3
    reps = max(3, min(reps, int(3.0 / max(first, 1e-6))))
    if device.type == "cuda" and first < 0.5:
        try:  # triton's do_bench: L2 flushed before each run, the launch queue kept full (as METHOD.md)
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            med, p20, p80 = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fn()
            torch.cuda.synchronize(device)
            return med, p20, p80, (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    else:
        times = []
        t_end = time.perf_counter() + min_time_s
        for i in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            if i >= 2 and time.perf_counter() > t_end and min_time_s:
                break
        peak = float("nan")
    qs = statistics.quantiles(times, n=5) if len(times) >= 5 else [min(times), 0, 0, max(times)]
    return statistics.median(times), qs[0], qs[3], peak


def median_ms(fn: Callable[[], object], device: torch.device | None = None) -> float:
    """Median time of ``fn`` in ms, measured as :func:`time_callable` does (for kernel drivers)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return time_callable(fn, device)[0]


# ----------------------------------------------------------------------------- cases


def _attention_case(op, b, s, skv, h, dqk, dv, k, sink, device, dtype, causal_indices=True):
    """Sparse attention (sink=True: DeepSeek-V4 style, else absorbed-MLA latent) at one shape."""
    from .ops import sparse_attention

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
    from .ops import causal_key_windows, indexer_topk, quantize_indexer_fp8

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
    from .ops import topk_rows

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


# ----------------------------------------------------------------------------- running and writing


def _env_info(device: torch.device) -> dict:
    def version(dist):
        import importlib.metadata as md

        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "-"

    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:
        sha = ""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "gpu": gpu, "torch": torch.__version__, "tilelang": version("tilelang"), "git": sha or "-",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }


def run_cases(cases: list[Case], providers: list[str], device: torch.device, modes=None, reps=30, warmup=5, log=print):
    env = _env_info(device)
    rows = []
    for case in cases:
        for mode in case.modes:
            if modes and mode not in modes:
                continue
            results = {}
            for provider in providers:
                row = {"op": case.op, "provider": provider, "mode": mode, "shape": case.shape, **env}
                try:
                    fn = case.make(provider, mode)
                    med, p20, p80, peak = time_callable(fn, device, warmup=warmup, reps=reps, min_time_s=2.0)
                except NotImplementedError:
                    continue
                except Exception as exc:  # an OOM or unsupported shape is a result, not a crash
                    row.update(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    rows.append(row)
                    log(f"{case.op:<22} {mode:<4} {case.shape:<40} {provider:<10} ERROR {row['error']}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                flops = case.flops.get(mode, 0.0)
                if provider == "sdpa":  # dense attention does Skv/k times the sparse work
                    flops *= case.meta.get("sdpa_flops_scale", 1.0)
                row.update(
                    median_ms=med, p20_ms=p20, p80_ms=p80,
                    tflops=flops / (med * 1e-3) / 1e12 if flops else float("nan"),
                    gbps=case.bytes.get(mode, 0.0) / (med * 1e-3) / 1e9,
                    peak_gib=peak,
                )
                anchor = ANCHORS.get((case.op, mode, case.shape))
                if anchor:
                    kind, value = anchor
                    row["vs_anchor"] = row["tflops"] / value if kind == "tflops" else value / med
                results[provider] = row
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            for provider, row in results.items():  # speed-ups over the baselines of the same run
                for base in ("torch", "sdpa", "torch.topk"):
                    if base in results and base != provider:
                        row[f"speedup_vs_{base}"] = results[base]["median_ms"] / row["median_ms"]
                log(
                    f"{case.op:<22} {mode:<4} {case.shape:<40} {provider:<10} {row['median_ms']:9.3f} ms "
                    f"{row['tflops']:8.1f} TFLOP/s  peak {row['peak_gib']:.2f} GiB"
                )
    return rows


COLUMNS = [
    "op", "mode", "shape", "provider", "median_ms", "p20_ms", "p80_ms", "tflops", "gbps", "peak_gib",
    "vs_anchor", "speedup_vs_torch", "speedup_vs_sdpa", "speedup_vs_torch.topk", "error",
    "gpu", "torch", "tilelang", "git", "date",
]


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "-" if value is None or value == "" else str(value)


def write_results(rows: list[dict], out_dir: Path, tag: str) -> tuple[Path, Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{tag}.csv", out_dir / f"{tag}.md"
    new = not csv_path.exists()
    with csv_path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: _fmt(row.get(c)) for c in COLUMNS})
    shown = [c for c in COLUMNS[:15] if any(c in r for r in rows)]
    env = rows[0] if rows else {}
    lines = [
        f"# {tag}",
        "",
        f"GPU: {env.get('gpu', '-')}; torch {env.get('torch', '-')}; tilelang {env.get('tilelang', '-')}; "
        f"git {env.get('git', '-')}; {env.get('date', '-')}",
        "",
        "| " + " | ".join(shown) + " |",
        "|" + "---|" * len(shown),
    ]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in shown) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path, _plot(rows, out_dir / f"{tag}.png")


def _plot(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in rows if "median_ms" in r]
    if not timed:
        return None
    labels = sorted({f"{r['op']} {r['mode']}\n{r['shape']}" for r in timed})
    providers = sorted({r["provider"] for r in timed})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        values = []
        for label in labels:
            match = [r for r in timed if r["provider"] == provider and f"{r['op']} {r['mode']}\n{r['shape']}" == label]
            values.append(match[0]["median_ms"] if match else 0.0)
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=provider)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=6, rotation=20, ha="right")
    ax.set_ylabel("median time (ms, log)")
    ax.set_yscale("log")
    ax.set_title(f"dsa_plugins benchmarks on {timed[0].get('gpu', '?')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


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
    rows = run_cases(cases, providers, device, args.modes.split(",") if args.modes else None, reps=reps)
    paths = write_results(rows, Path(args.out), args.tag or suite)
    print("wrote", ", ".join(str(p) for p in paths if p))
    return 0
