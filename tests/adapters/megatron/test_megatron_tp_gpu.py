"""Tensor parallel 2 (and + sequence parallel) on two GPUs with NCCL, through the TileLang kernels
in bf16, against tensor parallel 1. Skipped without two GPUs."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

WORKER = os.path.join(os.path.dirname(__file__), "tp_worker.py")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def test_tp2_and_sp_match_tp1_on_gpus(tmp_path):
    env = dict(os.environ, DSA_PLUGINS_AUTOLOAD="0", PYTHONWARNINGS="ignore", DSA_PLUGINS_BACKEND="tilelang")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    runs = {"tp1": ["1"], "tp2": ["2"], "tp2sp": ["2", "sp"]}
    for name, args in runs.items():  # one after the other: each takes the GPUs it needs
        proc = subprocess.run([sys.executable, WORKER, args[0], str(tmp_path / f"{name}.pt"), *args[1:], "cuda"],
                              env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, f"{name} worker failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    one = torch.load(tmp_path / "tp1.pt")
    for name in ("tp2", "tp2sp"):
        two = torch.load(tmp_path / f"{name}.pt")
        assert torch.isfinite(two["logits"]).all()
        assert _rel(two["logits"], one["logits"]) < 2e-2, name
        assert one["grads"].keys() == two["grads"].keys()
        # The indexer's gradient is softmax(I) - p_attn: a small difference of two distributions, and
        # each TP rank forms p_attn from its own heads in bf16 (equal to TP 1 in exact arithmetic,
        # as the CPU fp32 test checks to 1e-4): a looser bound there.
        errors = {n: _rel(two["grads"][n], g) for n, g in one["grads"].items()}
        print(name, {n: round(e, 4) for n, e in errors.items()})
        bad = {n: e for n, e in errors.items() if e > (1.5e-1 if ".indexer." in n else 5e-2)}
        assert not bad, f"{name}: {bad}"
