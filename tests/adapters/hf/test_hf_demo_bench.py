"""The demo (zero-code-change loading in a fresh process) and the benchmark's CPU smoke mode."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.value == "dsa_plugins._autoload:autoload" for ep in eps)


@pytest.mark.skipif(
    not _entry_point_installed(),
    reason="the torch.backends entry point is not installed: pip install --no-build-isolation --no-deps -e .",
)
def test_demo_runs_and_matches(tmp_path):
    env = dict(os.environ, DSA_PLUGINS_BACKEND="torch")
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, dsa_plugins.demo as d; sys.exit(d.main(['--new-tokens', '2', '--keep', sys.argv[1]]))", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GLM-5 (glm_moe_dsa)" in proc.stdout and "DeepSeek-V4 (deepseek_v4)" in proc.stdout
    assert "all models match eager" in proc.stdout
    assert (tmp_path / "glm_moe_dsa" / "model.safetensors").exists()


def test_demo_refuses_without_entry_point(monkeypatch, capsys):
    from dsa_plugins import demo

    monkeypatch.setattr(demo, "_entry_point_installed", lambda: False)
    assert demo.main([]) == 2
    assert "entry point" in capsys.readouterr().err


def test_bench_hf_layer_smoke(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_hf_layer
    finally:
        sys.path.pop(0)
    assert bench_hf_layer.main(["--smoke", "--providers", "dsa_tilelang"]) == 0
    out = capsys.readouterr().out
    assert "dsa_tilelang" in out and "S128" in out


def test_bench_hf_decode_smoke(capsys):
    """The decode benchmark's CPU mode: filled caches, eager dynamic and static steps; the static
    cache's first step gives the dynamic cache's output (same cache contents, same token)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_hf_decode
    finally:
        sys.path.pop(0)
    assert bench_hf_decode.main(["--smoke"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("smoke B")]
    assert any("eager_static" in line for line in lines) and any("sdpa" in line for line in lines)
    assert all(" diff 0 (" in line for line in lines if "dsa_tilelang" in line), lines


def test_bench_hf_decode_left_padding_masks_each_sequence_s_own_tokens():
    """``--left-pad``: sequence b masks its first b * pad / (B - 1) cached tokens (the first sequence none), so a
    padded step's output changes for the padded sequences only, and a dynamic cache (given the 2D mask) and a
    static one (given generate's mask, made before the forward) agree on it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_hf_decode
        from bench_hf_layer import build_layer
    finally:
        sys.path.pop(0)
    import dsa_plugins.hf

    assert bench_hf_decode.left_padding(3, 16, "cpu").tolist() == [0, 8, 16]
    dsa_plugins.hf.register()
    model, _ = build_layer("glm5", "dsa_tilelang", True, torch.device("cpu"), torch.float32)
    model.eval()
    masks, forward = [], model.forward

    def recording_forward(**kw):
        if kw.get("position_ids") is not None:  # a decode step (the cache's short prefill passes none)
            masks.append(kw.get("attention_mask"))
        return forward(**kw)

    model.forward = recording_forward
    outs = {}
    for mode, pad in [("eager_dynamic", 0), ("eager_dynamic", 24), ("eager_static", 24)]:
        masks.clear()
        outs[mode, pad] = bench_hf_decode.decode_steps(model, mode, 3, 64, 1, torch.device("cpu"), torch.float32,
                                                       pad=pad)[2]
        assert len(masks) == 4  # 3 warm steps and 1 timed one
        if pad and mode == "eager_dynamic":  # each step: the cache so far and the new token, the padding masked
            for i, mask in enumerate(masks):
                assert mask.shape == (3, 64 + i + 1)
                assert mask[:, :24].sum(1).tolist() == [24, 12, 0] and bool(mask[:, 24:].all())
        elif pad:  # a static cache: generate's mask, made before the forward over the cache's whole length
            assert all(not isinstance(mask, torch.Tensor) or mask.ndim == 4 for mask in masks), masks[0]
        else:
            assert all(mask is None for mask in masks)
    plain, padded = outs["eager_dynamic", 0], outs["eager_dynamic", 24]
    torch.testing.assert_close(padded[0], plain[0])  # no padding: the same step
    assert all((padded[b] - plain[b]).abs().max() > 1e-4 for b in (1, 2))
    torch.testing.assert_close(outs["eager_static", 24], padded)


def test_demo_verdict_does_not_compare_a_model_whose_eager_baseline_fails(capsys):
    """transformers 5.17 cannot run DeepSeek-V4's own eager path in bf16 (loaded with dtype=bfloat16, a float
    input meets a bf16 weight): that row is reported as not compared, never as a match or a mismatch; with
    nothing compared at all the demo fails."""
    from dsa_plugins.demo import _verdict

    good = dict(model="GLM-5", max_logit_diff=0.0, logit_scale=1.0, tokens_equal=True, divergence_gap=0.0,
                finite=True, time_dsa=0.1, time_eager=0.1)
    skipped = dict(model="DeepSeek-V4", skipped="transformers 5.17's own eager bfloat16 forward fails: RuntimeError")
    assert _verdict(dict(rows=[good, skipped], autoloaded=True), gpu=True) == (True, [
        "DeepSeek-V4 (transformers 5.17's own eager bfloat16 forward fails: RuntimeError)"])
    assert _verdict(dict(rows=[skipped], autoloaded=True), gpu=True)[0] is False
    assert _verdict(dict(rows=[dict(good, max_logit_diff=1.0)], autoloaded=True), gpu=True)[0] is False
    assert "no model could be compared" in capsys.readouterr().err
