"""Shared pieces of the same-run peer benchmarks (never imported by the package).

A peer is another stack's kernel that users could pick instead of ours (cuDNN frontend, FlashMLA).
It is staged on the GPU machine (``../shared/device/stage_*.sh``), imported if present, run in the
same process on the same inputs as ours, and its outputs are checked against ours before it is
timed. Rows go to ``benchmarks/results/<tag>.csv`` with ``dsa_plugins.bench.runner``'s columns.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dsa_plugins.bench.runner import env_info, time_callable, write_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
AGREE = 1e-2  # relative L2 difference allowed between ours and a peer (bf16 outputs)

_STAGING = {
    "cudnn_fe": "bash ../shared/device/stage_cudnn_fe.sh, then source .peers/cudnn_fe/setup.sh on the GPU machine",
    "flashmla": "bash ../shared/device/stage_flashmla.sh <FlashMLA snapshot>, then source .peers/flashmla/setup.sh",
}


def import_peer(module: str, provider: str):
    """The peer's module, or None with one line saying why it is absent and how to stage it."""
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "absent"
        print(f"peer {provider} absent ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
              f"stage it with: {_STAGING.get(provider, '?')}", flush=True)
        return None


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32; NaN anywhere gives inf (NaN never passes)."""
    a, b = a.float(), b.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def error_text(exc: Exception) -> str:
    """An exception as one short line for a row's error column."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def show_row(row: dict) -> None:
    """Print one row: op, mode, shape, provider and its time (or its error)."""
    shown = f"{row['median_ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s" if "median_ms" in row else f"ERROR {row['error']}"
    print(f"{row['op']:<24} {row['mode']:<4} {row['shape']:<44} {row['provider']:<18} {shown}", flush=True)


class Rows:
    """Collects the rows of one run and writes them (appending) to ``benchmarks/results/<tag>.csv``."""

    def __init__(self, tag: str, out_dir: Path | None = None):
        self.tag, self.out_dir = tag, Path(out_dir or os.environ.get("DSA_PLUGINS_BENCH_OUT", RESULTS))
        self.env = env_info(torch.device("cuda"))
        self.rows: list[dict] = []
        self._written = 0

    def time(self, op: str, mode: str, shape: str, provider: str, fn: Callable[[], object], flops: float,
             error: str | None = None, **extra) -> dict:
        """Time ``fn`` (unless ``error``: the row records why it was not timed) and add a row."""
        row = {"op": op, "mode": mode, "shape": shape, "provider": provider, **self.env, **extra}
        if error is None:
            try:
                med, p20, p80, peak = time_callable(fn, torch.device("cuda"))
                row.update(median_ms=med, p20_ms=p20, p80_ms=p80, peak_gib=peak,
                           tflops=flops / (med * 1e-3) / 1e12 if flops else float("nan"))
            except Exception as exc:  # noqa: BLE001 - an OOM or a peer's refusal is a result
                error = error_text(exc)
        if error is not None:
            row["error"] = error
        self.rows.append(row)
        show_row(row)
        torch.cuda.empty_cache()
        return row

    def ratios(self, ours: str = "tilelang") -> None:
        """Print ours / peer for each (op, mode, shape) of this run."""
        by_case: dict[tuple, dict[str, dict]] = {}
        for r in self.rows:
            name = r["provider"] + (f" {r['variant']}" if r.get("variant") else "")
            by_case.setdefault((r["op"], r["mode"], r["shape"]), {})[name] = r
        for (op, mode, shape), rs in by_case.items():
            for mine, m in rs.items():
                if not mine.startswith(ours) or "median_ms" not in m:
                    continue
                for p, r in rs.items():
                    if not p.startswith(ours) and "median_ms" in r:
                        print(f"  {op} {mode} {shape}: {mine} / {p} speed = {r['median_ms'] / m['median_ms']:.3f}")

    def write(self) -> None:
        """Append the rows not written yet (call it after each case: a timed-out run keeps what it measured)."""
        if len(self.rows) > self._written:
            print("wrote", write_results(self.rows[self._written:], self.out_dir, self.tag)[:2], flush=True)
            self._written = len(self.rows)
