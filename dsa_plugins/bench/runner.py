"""Benchmark runner: times cases, writes CSV + markdown + a plot (the suites are in :mod:`.suites`).

Each row: op, provider, mode (fwd/bwd/full), shape, median and 20/80% quantiles in ms (CUDA events
on GPU, perf_counter on CPU; many runs after warm-up), TFLOP/s, minimum bytes moved and GB/s,
peak memory, the ratio to the anchor figure of the issue (measured on an H200 with TileLang's
examples) and to the torch reference / dense SDPA rows of the same run, GPU name, versions, git sha.
FLOPs of sparse attention are counted over all k slots (fwd 2*H*k*(Dqk+Dv), bwd 2*H*k*(2*Dv+3*Dqk)
per query), as FlashMLA and TileLang count them.
"""

from __future__ import annotations

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


def capture_graph(fn: Callable[[], object], warmup: int = 2) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmup`` calls on a side stream (compiles, allocations and
    lazy set-up stay outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Mean ms per replay over ``reps`` back-to-back replays of ``graph`` (no host time in the figure)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / reps


def interleaved_ms(items: list, rounds: int, measure: Callable[[object], float]) -> list[list[float]]:
    """``measure(item)`` of each item once per round for ``rounds`` rounds, in forward order on even rounds and
    backward on odd ones, so that the GPU's drift during a run falls on every item alike (A/B decisions of a few
    percent). A None item (a variant a shape cannot take) gets no times."""
    times: list[list[float]] = [[] for _ in items]
    for r in range(rounds):
        for i in range(len(items)) if r % 2 == 0 else reversed(range(len(items))):
            if items[i] is not None:
                times[i].append(measure(items[i]))
    return times


def interleaved_graph_ms(graphs: list, rounds: int, replays: int) -> list[list[float]]:
    """Mean ms per replay of each CUDA graph (``graph_replay_ms``) in alternating rounds (``interleaved_ms``)."""
    return interleaved_ms(graphs, rounds, lambda g: graph_replay_ms(g, replays))


def calls_ms(fn: Callable[[], object], budget_ms: float = 150.0) -> float:
    """Median ms of back-to-back eager calls of ``fn`` (CUDA events around each, host time included) filling
    about ``budget_ms``, at least 3: for calls that cannot be captured (a host sync inside)."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while len(times) < 3 or sum(times) < budget_ms:
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def interleaved_calls_ms(fns: list, rounds: int, budget_ms: float = 150.0) -> list[list[float]]:
    """``calls_ms`` of each callable in alternating rounds (``interleaved_ms``)."""
    return interleaved_ms(fns, rounds, lambda f: calls_ms(f, budget_ms))


def ratio_text(base: list[float], times: list[float]) -> str:
    """``base / times`` per round as "median [min, max]" (> 1: ``times`` is the faster)."""
    ratios = [a / b for a, b in zip(base, times)]
    return f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"


# ----------------------------------------------------------------------------- running and writing


def env_info(device: torch.device) -> dict:
    def version(dist):
        import importlib.metadata as md

        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "-"

    # DSA_PLUGINS_GIT names the code's commit where the checkout's own HEAD does not (a copy of the
    # working tree sent to a GPU machine carries a stale .git)
    sha = os.environ.get("DSA_PLUGINS_GIT", "").strip()
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 timeout=5).stdout.strip()
        except Exception:
            sha = ""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "gpu": gpu, "torch": torch.__version__, "tilelang": version("tilelang"), "git": sha or "-",
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
    }


def run_cases(cases: list[Case], providers: list[str], device: torch.device, modes=None, reps=30, warmup=5, log=print,
              anchors: dict | None = None):
    """Time every case x mode x provider; rows carry TFLOP/s, GB/s, peak memory, the ratio to
    ``anchors[(op, mode, shape)] = ("tflops" | "ms", value)`` and speed-ups over the same run's baselines."""
    env = env_info(device)
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
                anchor = (anchors or {}).get((case.op, mode, case.shape))
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
    "op", "mode", "shape", "provider", "variant", "median_ms", "p20_ms", "p80_ms", "tflops", "gbps", "peak_gib",
    "vs_anchor", "speedup_vs_torch", "speedup_vs_sdpa", "speedup_vs_torch.topk", "error",
    "gpu", "torch", "tilelang", "git", "date",
]


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "-"
        if abs(value) < 1:  # microsecond kernels in ms, ratios: four significant digits
            return f"{value:.4g}"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "-" if value is None or value == "" else str(value)


def _upgrade_columns(csv_path: Path) -> None:
    """Rewrite a results file written with an older column list under today's (missing columns
    read "-"), so that appended rows line up with its header."""
    if not csv_path.exists():
        return
    with csv_path.open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == COLUMNS:
            return
        if not set(reader.fieldnames or ()) <= set(COLUMNS):
            raise ValueError(f"{csv_path} has columns of its own ({reader.fieldnames}): results go to another file")
        old = list(reader)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({c: r.get(c) or "-" for c in COLUMNS} for r in old)


def write_results(rows: list[dict], out_dir: Path, tag: str) -> tuple[Path, Path, Path | None]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{tag}.csv", out_dir / f"{tag}.md"
    _upgrade_columns(csv_path)
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


