"""dsa_plugins as megatron-core 0.19's DSA kernel backend (CPU, gloo; runs where megatron >= 0.19 is
installed, i.e. the Python 3.12 CI venv).

Oracle: megatron's own torch path (``dsa_kernel_backend="none"`` with the takeover off) on the same
weights and tokens: loss, every gradient and the logged indexer loss agree in fp32; 50 training
steps follow the same loss curve. megatron's torch top-k (``torch.topk``) breaks exact ties (ReLU
zeros are common in these random models) in no defined order; the oracle takes the canonical rule
(the lowest key wins, as every dsa_plugins path), or a tie flips one key and the runs drift apart.
"""

from __future__ import annotations

import os

import pytest
import torch

from dsa_plugins.adapters import megatron as adapter

import mcore019 as M  # noqa: E402  (this folder is on sys.path; collected with megatron 0.19.x only, see conftest.py)

RTOL = 1e-4

#: the tests that run the CPU model: with a GPU present megatron 0.19 builds its RoPE tables on the current CUDA
#: device (the CPU shims step aside there, as a GPU process needs the real ``current_device``), so the CPU model
#: cannot run; test_megatron019_gpu.py checks the backend on the GPU
cpu_model = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model of megatron 0.19 needs a machine "
                               "without CUDA (RoPE on the current CUDA device); test_megatron019_gpu.py covers the GPU")


@pytest.fixture(scope="module", autouse=True)
def world():
    M.apply_cpu_shims()
    M.init_distributed(port=29600 + os.getpid() % 300)
    adapter.register()
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def canonical_megatron_topk(monkeypatch):
    """megatron's torch top-k with the lowest-index tie rule (same scores, same -1 padding)."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    real = dsa.fused_qk_topk_naive

    def fused_qk_topk_naive(q, k, weights, index_topk, *args, **kwargs):
        scores, indices = real(q, k, weights, index_topk, *args, **kwargs)
        order = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[..., : indices.shape[-1]]
        return scores, order.masked_fill(scores.gather(-1, order) == float("-inf"), -1)

    monkeypatch.setattr(dsa, "fused_qk_topk_naive", fused_qk_topk_naive)


def _run(backend: str, takeover: bool, monkeypatch, **build_kw):
    monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", "1" if takeover else "0")
    cfg, model = M.build(backend=backend, **build_kw)
    tokens, labels = M.batch()
    return M.step(model, tokens, labels)


def _assert_same(got, want):
    (loss, grads, tracker), (loss0, grads0, tracker0) = got, want
    torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads0.keys()
    for name, g0 in grads0.items():
        err = float((grads[name] - g0).norm() / g0.norm().clamp_min(1e-30))
        assert err < RTOL, f"{name}: rel err {err:.2e}"
    if tracker0 is None:
        assert tracker is None or float(tracker.abs().sum()) == 0.0
    else:
        torch.testing.assert_close(tracker, tracker0, rtol=1e-5, atol=1e-8)


def test_registration_is_idempotent_reversible_and_takes_over_none(monkeypatch):
    from megatron.core.transformer.experimental_attention_variant import dsa, dsa_kernels

    from dsa_plugins.adapters.megatron import backend_patches

    assert backend_patches.is_applied() and adapter.is_registered()
    forward = dsa.DSAttention.forward
    adapter.register()  # a second time: nothing changes
    assert dsa.DSAttention.forward is forward
    cfg, _ = M.build(backend="none")
    assert dsa_kernels._get_dsa_kernel_backend(cfg) == "dsa_plugins"
    monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", "0")
    assert dsa_kernels._get_dsa_kernel_backend(cfg) == "none"
    explicit, _ = M.build(backend="dsa_plugins")  # the config validation accepts the name
    assert dsa_kernels._get_dsa_kernel_backend(explicit) == "dsa_plugins"
    adapter.unregister()
    try:
        assert "dsa_plugins" not in dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND
        assert dsa.DSAttention.forward is not forward and not backend_patches.is_applied()
        with pytest.raises(ValueError, match="dsa_kernel_backend"):
            M.build(backend="dsa_plugins")
    finally:
        adapter.register()
    assert backend_patches.is_applied()


def test_unsupported_megatron_version_is_named(monkeypatch):
    from packaging.version import Version

    from dsa_plugins.patches import UnsupportedVersion

    monkeypatch.setattr(adapter, "megatron_version", lambda: Version("0.18.0"))
    with pytest.raises(UnsupportedVersion, match=r"0\.16\.0 <= v < 0\.17\.0.*0\.19\.0 <= v < 0\.20\.0"):
        adapter.register()


@cpu_model
@pytest.mark.parametrize("case", [
    dict(sparse_loss=True), dict(sparse_loss=False), dict(loss_coeff=0.0), dict(topk=64),
], ids=["sparse-loss", "dense-loss", "no-loss", "topk-above-length"])
def test_matches_megatron_torch_path(case, monkeypatch):
    want = _run("none", False, monkeypatch, **case)
    _assert_same(_run("dsa_plugins", True, monkeypatch, **case), want)
    _assert_same(_run("none", True, monkeypatch, **case), want)  # a config left at "none": taken over


@cpu_model
def test_hooks_run_and_the_loss_is_fused(monkeypatch):
    """The full-layer hook serves training layers: the sparse loss comes from the attention's backward,
    the dense (warm-up) loss from the windows' loss op."""
    from dsa_plugins.adapters.megatron import backend
    from dsa_plugins.ops import FusedIndexerLoss

    calls = []
    real_init = FusedIndexerLoss.__init__
    monkeypatch.setattr(FusedIndexerLoss, "__init__",
                        lambda self, *a, **k: calls.append(1) or real_init(self, *a, **k))
    real_hook = backend.run_fused_dsa_attention
    served = []
    monkeypatch.setattr(backend, "run_fused_dsa_attention", lambda **k: served.append(r := real_hook(**k)) or r)
    _run("dsa_plugins", True, monkeypatch)
    assert len(served) == 2 and all(r is not None for r in served) and len(calls) == 2
    served.clear()
    _run("dsa_plugins", True, monkeypatch, sparse_loss=False)  # dense warm-up: served too, loss not fused
    assert len(served) == 2 and all(r is not None for r in served) and len(calls) == 2


@cpu_model
def test_eval_and_packed_sequences_match(monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=11, max_seqlen_kv=11)
    tokens, labels = M.batch(b=1)
    position_ids = torch.cat([torch.arange(5), torch.arange(11)]).unsqueeze(0)
    results = {}
    for backend, takeover in (("none", "0"), ("dsa_plugins", "1")):
        monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", takeover)
        _, model = M.build(backend=backend)
        results[backend] = M.step(model, tokens, labels, position_ids=position_ids, packed_seq_params=packed)
        model.eval()
        with torch.no_grad():
            results[backend + "-eval"] = model(tokens, position_ids, attention_mask=None, packed_seq_params=packed)
    _assert_same(results["dsa_plugins"], results["none"])
    torch.testing.assert_close(results["dsa_plugins-eval"], results["none-eval"], rtol=1e-5, atol=1e-5)


@cpu_model
def test_fifty_training_steps_follow_megatrons_curve(monkeypatch):
    curves = {}
    for backend, takeover in (("none", "0"), ("dsa_plugins", "1")):
        monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", takeover)
        _, model = M.build(backend=backend, loss_coeff=0.1, sparse_loss=True)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        curve = []
        for it in range(50):
            tokens, labels = M.batch(seed=100 + it % 5)
            loss, _, _ = M.step(model, tokens, labels)
            opt.step()
            curve.append(float(loss))
        curves[backend] = torch.tensor(curve)
    assert curves["dsa_plugins"][-1] < curves["dsa_plugins"][0]  # it trains
    rel = ((curves["dsa_plugins"] - curves["none"]).abs() / curves["none"]).max()
    dev = (curves["dsa_plugins"] - curves["none"]).abs() / curves["none"]
    # the same function: the first steps agree to rounding. Later, fp32 rounding differences (a
    # different summation order) grow chaotically under Adam as the model memorises its five
    # batches: on one 2-core CPU the curves stayed within 1%, on another they agreed to 1e-6 for 18
    # steps and then drifted to 1.5% at step 46 (0.4% at the last step, 0.2% on average)
    assert dev[:15].max() < 1e-4, f"the first steps differ by {float(dev[:15].max()):.2e}"
    assert dev.mean() < 0.01 and dev[-1] < 0.01, f"loss curves differ by {float(dev.mean()):.2%} on average, " \
        f"{float(dev[-1]):.2%} at the last step"
    assert rel < 0.03, f"loss curves differ by {float(rel):.2%}"


@cpu_model
@pytest.mark.parametrize("per_token", [False, True], ids=["mean", "per-token"])
def test_standalone_loss_hook_takes_padding_rows(per_token, monkeypatch):
    """Layers whose full hook declines go through the top-k + loss hook: with padded packed sequences
    (megatron's real-token mask) and per-token losses it reduces the KL as megatron does (row weights),
    instead of declining to the torch path."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsa_plugins.adapters.megatron import backend

    served = []
    real = backend.run_fused_qk_topk_with_loss
    monkeypatch.setattr(backend, "run_fused_dsa_attention", lambda **k: None)
    monkeypatch.setattr(backend, "run_fused_qk_topk_with_loss",
                        lambda *a, **k: served.append(r := real(*a, **k)) or r)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    cu_padded = torch.tensor([0, 6, 16], dtype=torch.int32)
    real_rows = torch.ones(1, 16, dtype=torch.bool)
    real_rows[0, 5] = real_rows[0, 14:] = False
    tokens, labels = M.batch(b=1)
    position_ids = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    results = {}
    for name, takeover in (("none", "0"), ("dsa_plugins", "1")):
        monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", takeover)
        cfg, model = M.build(backend=name)
        cfg.calculate_per_token_loss = per_token
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                                 cu_seqlens_kv_padded=cu_padded, max_seqlen_q=10, max_seqlen_kv=10)
        packed.real_token_mask_q = real_rows
        results[name] = M.step(model, tokens, labels, position_ids=position_ids, packed_seq_params=packed)
    assert len(served) == 2 and all(r is not None for r in served)
    _assert_same(results["dsa_plugins"], results["none"])


@cpu_model
@pytest.mark.parametrize("deterministic_mode", [False, True])
def test_megatron_deterministic_mode_takes_the_deterministic_backward(deterministic_mode, monkeypatch):
    """megatron's ``config.deterministic_mode`` (its switch for reproducible kernels) puts the layers' attention
    ops under dsa_plugins.deterministic(): their backward is the bitwise-reproducible one; off, the default."""
    from dsa_plugins.ops import attention_custom_ops, fused_indexer_loss

    seen = []
    for mod in (attention_custom_ops, fused_indexer_loss):
        real = mod.deterministic_enabled
        monkeypatch.setattr(mod, "deterministic_enabled", lambda real=real: seen.append(real()) or seen[-1])
    monkeypatch.setenv("DSA_PLUGINS_MEGATRON_TAKEOVER", "1")
    cfg, model = M.build(backend="dsa_plugins")
    cfg.deterministic_mode = deterministic_mode
    tokens, labels = M.batch()
    M.step(model, tokens, labels)
    assert seen and all(v == deterministic_mode for v in seen)
