"""dsa_plugins' Megatron-core DSA modules on CPU (one process, gloo), against megatron's own DSA."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("megatron.core")

SEQ, BATCH, VOCAB = 12, 2, 97


def _gpt(config, spec):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="none")


def _tokens(seed=0, batch=BATCH, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return tok, torch.arange(seq)[None].expand(batch, -1)


def _megatron_reference_spec(config):
    """Megatron 0.16's own DSA (MLASelfAttention + DSAttention + DSAIndexer) on local modules."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from dsa_plugins.adapters.megatron.layers import DuplicatedLinear
    from dsa_plugins.adapters.megatron.specs import get_dsa_module_spec

    ours = get_dsa_module_spec(config, model="megatron")
    attn = copy.deepcopy(ours)
    attn.module = MLASelfAttention
    subs = attn.submodules
    subs.linear_q_down_proj = ColumnParallelLinear
    subs.linear_kv_down_proj = ColumnParallelLinear
    subs.core_attention.module = mdsa.DSAttention
    subs.core_attention.params = {}
    subs.core_attention.submodules.indexer.module = mdsa.DSAIndexer
    subs.core_attention.submodules.indexer.params = {}
    for name in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
        setattr(subs.core_attention.submodules.indexer.submodules, name, DuplicatedLinear)
    layer = get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization=config.normalization
    )
    layer.submodules.self_attention = attn
    return layer


@pytest.fixture
def registered(megatron_env):
    import dsa_plugins.megatron as dm

    was_registered = dm.is_registered()
    dm.register()
    yield dm
    if not was_registered:
        dm.unregister()


def test_builds_through_megatron_spec_functions(registered, tiny_config):
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec,
    )

    from dsa_plugins.adapters.megatron.attention import AbsorbedMLASelfAttention, DSAttention
    from dsa_plugins.adapters.megatron.indexer import DSAIndexer

    config = tiny_config()
    torch.manual_seed(0)
    model = _gpt(config, get_transformer_block_with_experimental_attention_variant_spec(config=config))
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention, AbsorbedMLASelfAttention)
    assert isinstance(layer.self_attention.core_attention, DSAttention)
    assert isinstance(layer.self_attention.core_attention.indexer, DSAIndexer)
    tok, pos = _tokens()
    logits = model(tok, pos, None)
    assert logits.shape == (BATCH, SEQ, VOCAB) and torch.isfinite(logits).all()
    logits.float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_patch_is_idempotent_and_reversible(megatron_env, tiny_config):
    import megatron.core.models.gpt.experimental_attention_variant_module_specs as mod

    from dsa_plugins.adapters.megatron import ADAPTER
    from dsa_plugins.adapters.megatron.spec_patches import apply_dsa_to_megatron, revert_dsa_from_megatron

    was_registered = ADAPTER.is_registered()  # autoload may have registered it on import
    ADAPTER.unregister()
    originals = (mod.get_experimental_attention_variant_module_spec, mod._get_backend_spec_provider,
                 mod.get_dsa_module_spec_for_backend)
    config = tiny_config()
    with pytest.raises((ValueError, AssertionError)):
        mod.get_transformer_block_with_experimental_attention_variant_spec(config=config)
    assert not ADAPTER.is_registered()
    assert apply_dsa_to_megatron() is True
    patched = mod.get_experimental_attention_variant_module_spec
    assert apply_dsa_to_megatron() is False  # second call: no-op
    ADAPTER.register()
    assert mod.get_experimental_attention_variant_module_spec is patched
    assert ADAPTER.is_registered()
    mod.get_transformer_block_with_experimental_attention_variant_spec(config=config)
    assert revert_dsa_from_megatron() == 3
    assert (mod.get_experimental_attention_variant_module_spec, mod._get_backend_spec_provider,
            mod.get_dsa_module_spec_for_backend) == originals
    assert not ADAPTER.is_registered()
    ADAPTER.unregister()  # nothing left to undo: harmless
    if was_registered:
        ADAPTER.register()


def _build_pair(config, monkeypatch, absorbed=True):
    """(megatron's DSA model, ours with the "megatron" preset) holding the same weights.
    ``absorbed=False``: our DSAttention under megatron's own MLASelfAttention (per-head K/V)."""
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa

    from dsa_plugins.megatron import get_dsa_layer_spec

    # megatron's Hadamard needs fast_hadamard_transform + bf16; it is orthonormal, so on fp32
    # inputs the identity gives the same index scores up to rounding.
    monkeypatch.setattr(mdsa, "rotate_activation", lambda x: x)
    torch.manual_seed(0)
    ref = _gpt(config, _megatron_reference_spec(config))
    spec = get_dsa_layer_spec(config, model="megatron", hadamard=False)
    if not absorbed:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        spec.submodules.self_attention = copy.copy(spec.submodules.self_attention)
        spec.submodules.self_attention.module = MLASelfAttention
    ours = _gpt(config, spec)
    missing, unexpected = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return ref, ours


@pytest.mark.parametrize("sparse_loss,absorbed,fused", [(False, True, True), (True, True, True), (True, True, False),
                                                        (True, False, True)])
def test_matches_megatron_dsa(megatron_env, tiny_config, monkeypatch, sparse_loss, absorbed, fused):
    """Same weights: logits, indexer loss and every gradient equal megatron's unfused DSA (the
    sparse-stage loss fused into the attention backward, or the standalone op)."""
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa

    from dsa_plugins.adapters.megatron.attention import DSAttention

    config = tiny_config(dsa_indexer_use_sparse_loss=sparse_loss)
    ref, ours = _build_pair(config, monkeypatch, absorbed)
    for m in ours.modules():
        if isinstance(m, DSAttention):
            m.fuse_indexer_loss = fused
    losses = {}

    tok, pos = _tokens(1)
    results = {}
    for name, model in (("ref", ref), ("ours", ours)):
        # the fused loss is logged from the backward (layers in reverse): key by layer
        monkeypatch.setattr(
            mdsa.DSAIndexerLossLoggingHelper, "save_loss_to_tracker",
            staticmethod(lambda loss, layer_number, num_layers, _n=name, **kw: losses.setdefault(_n, {}).setdefault(
                layer_number, loss.detach().clone())),
        )
        model.train()
        logits = model(tok, pos, None)
        logits.float().square().mean().backward()
        results[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})

    torch.testing.assert_close(results["ours"][0], results["ref"][0], rtol=1e-5, atol=1e-5)
    assert sorted(losses["ours"]) == sorted(losses["ref"]) == list(range(1, config.num_layers + 1))
    for layer, b in losses["ref"].items():
        torch.testing.assert_close(losses["ours"][layer], b, rtol=1e-4, atol=1e-6)
    g_ours, g_ref = results["ours"][1], results["ref"][1]
    assert g_ours.keys() == g_ref.keys()
    for n in g_ref:
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_core_attention_matches_unfused_dsa_fn(megatron_env, tiny_config):
    """Per-head and absorbed inputs of DSAttention against megatron's unfused_dsa_fn."""
    from megatron.core.transformer.experimental_attention_variant.dsa import unfused_dsa_fn

    from dsa_plugins.adapters.megatron import attention as att

    g = torch.Generator().manual_seed(3)
    s, b, h, c, r, dn, dv, k = 10, 2, 4, 16, 8, 8, 8, 4
    q_nope, q_pe = torch.randn(s, b, h, dn, generator=g), torch.randn(s, b, h, r, generator=g)
    latent, k_pe = torch.randn(s, b, c, generator=g), torch.randn(s, b, r, generator=g)
    w = torch.randn(h, dn + dv, c, generator=g) * 0.3
    w_kc, w_vc = w[:, :dn], w[:, dn:]
    key = torch.cat([torch.einsum("sbc,hdc->sbhd", latent, w_kc), k_pe[:, :, None].expand(-1, -1, h, -1)], -1)
    value = torch.einsum("sbc,hdc->sbhd", latent, w_vc)
    query = torch.cat([q_nope, q_pe], -1)
    # top-k positions per (b, s): random causal subsets, -1 padded
    pos = torch.full((b, s, k), -1, dtype=torch.long)
    for bi in range(b):
        for si in range(s):
            sel = torch.randperm(si + 1, generator=g)[:k]
            pos[bi, si, : len(sel)] = sel
    scale = 0.3
    # megatron's scatter cannot take -1: point padding at key 0 (always selected in short rows)
    expect = unfused_dsa_fn(query, key, value, pos.clamp_min(0), scale)

    core = att.DSAttention.__new__(att.DSAttention)
    torch.nn.Module.__init__(core)
    core.softmax_scale, core.backend = scale, None
    rows = torch.where(pos >= 0, pos + (torch.arange(b) * s)[:, None, None], -1).reshape(b * s, k).to(torch.int32)
    q_rows = att._to_rows(query, False)
    per_head = core._per_head_attention(q_rows, att._to_rows(key, False), att._to_rows(value, False), rows)
    got = per_head.reshape(b, s, -1).transpose(0, 1)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)

    from dsa_plugins import ops

    q_abs = torch.cat([torch.einsum("sbhd,hdc->sbhc", q_nope, w_kc), q_pe], -1)
    kv_lat = torch.cat([latent, k_pe], -1)
    out = ops.sparse_mla(att._to_rows(q_abs, False), att._to_rows(kv_lat, False), rows, w_vc, scale)
    torch.testing.assert_close(out.reshape(b, s, -1).transpose(0, 1), expect, rtol=1e-5, atol=1e-5)


def test_indexer_loss_trains_only_the_indexer(megatron_env, tiny_config, monkeypatch):
    from dsa_plugins.megatron import get_dsa_layer_spec

    config = tiny_config(dsa_indexer_loss_coeff=0.5)
    torch.manual_seed(0)
    model = _gpt(config, get_dsa_layer_spec(config, model="glm5"))
    model.train()
    tok, pos = _tokens(2)
    (model(tok, pos, None).float().sum() * 0.0).backward()  # main loss contributes zero gradient
    for name, p in model.named_parameters():
        nonzero = p.grad is not None and p.grad.abs().sum() > 0
        assert nonzero == (".indexer." in name), name

    model.zero_grad(set_to_none=True)
    config.dsa_indexer_loss_coeff = 0.0  # no loss: the main loss never reaches the indexer
    model(tok, pos, None).float().square().mean().backward()
    for name, p in model.named_parameters():
        if ".indexer." in name:
            assert p.grad is None or p.grad.abs().sum() == 0, name


def test_packed_thd_matches_bshd(megatron_env, tiny_config):
    """One sequence as THD (cu_seqlens) gives the bshd result; two packed sequences stay apart."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from dsa_plugins.megatron import get_dsa_layer_spec

    config = tiny_config(dsa_indexer_loss_coeff=0.0)
    torch.manual_seed(0)
    model = _gpt(config, get_dsa_layer_spec(config, model="deepseek_v32")).eval()
    tok_a, _ = _tokens(4, batch=1, seq=7)
    tok_b, _ = _tokens(5, batch=1, seq=9)
    with torch.no_grad():
        ref_a = model(tok_a, torch.arange(7)[None], None)
        ref_b = model(tok_b, torch.arange(9)[None], None)
        cu = torch.tensor([0, 7, 16], dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
        tok = torch.cat([tok_a, tok_b], 1)
        posn = torch.cat([torch.arange(7), torch.arange(9)])[None]
        got = model(tok, posn, None, packed_seq_params=psp)
    torch.testing.assert_close(got[:, :7], ref_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:, 7:], ref_b, rtol=1e-5, atol=1e-5)


def test_unsupported_version_refuses_to_patch(megatron_env, monkeypatch):
    import megatron.core.models.gpt.experimental_attention_variant_module_specs as mod

    from dsa_plugins.patches import UnsupportedVersion
    from dsa_plugins.adapters.megatron import spec_patches as patch

    was_registered = patch.is_applied()
    patch.revert_dsa_from_megatron()
    before = mod.get_experimental_attention_variant_module_spec
    monkeypatch.setattr(patch, "SUPPORTED", ("99.0", "100.0"))
    with pytest.raises(UnsupportedVersion):
        patch.apply_dsa_to_megatron()
    assert mod.get_experimental_attention_variant_module_spec is before and not patch.is_applied()
    monkeypatch.undo()
    if was_registered:
        patch.apply_dsa_to_megatron()


def test_shared_topk_layers_train(megatron_env, tiny_config):
    """GLM-5 "shared" layers: no indexer, the previous layer's top-k; the loss trains full layers."""
    from dsa_plugins.megatron import get_dsa_decoder_block_spec

    config = tiny_config(num_layers=3)
    torch.manual_seed(0)
    model = _gpt(config, get_dsa_decoder_block_spec(config, indexer_types=["full", "shared", "shared"]))
    attn = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert attn[0].indexer is not None and attn[1].indexer is None and attn[2].indexer is None
    assert attn[0].topk_carrier is attn[2].topk_carrier
    tok, pos = _tokens(3)
    model(tok, pos, None).float().square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    with pytest.raises(ValueError):
        get_dsa_decoder_block_spec(config, indexer_types=["full", "shared"])


@pytest.mark.parametrize("sparse_loss,fused", [(True, True), (True, False), (False, True)],
                         ids=["sparse-fused", "sparse-standalone", "dense-stage"])
@pytest.mark.parametrize("deterministic_mode", [False, True])
def test_megatron_deterministic_mode_takes_the_deterministic_backward(megatron_env, tiny_config, monkeypatch,
                                                                     deterministic_mode, sparse_loss, fused):
    """megatron's ``config.deterministic_mode`` puts DSAttention's attention ops and the indexer loss (fused into
    the attention backward, or the standalone op: ``fuse_indexer_loss = False`` or the dense warm-up stage) under
    dsa_plugins.deterministic(): their backward is the bitwise-reproducible one. (The standalone loss once ran
    after the deterministic block: its d_index_k took the atomic sum.)"""
    from dsa_plugins import ops
    from dsa_plugins.adapters.megatron.attention import DSAttention
    from dsa_plugins.common import settings
    from dsa_plugins.megatron import get_dsa_layer_spec
    from dsa_plugins.ops import attention_custom_ops, fused_indexer_loss

    seen = []
    for mod in (attention_custom_ops, fused_indexer_loss):
        real = mod.deterministic_enabled
        monkeypatch.setattr(mod, "deterministic_enabled", lambda real=real: seen.append(real()) or seen[-1])
    standalone = []
    real_loss = ops.indexer_kl_loss

    def indexer_kl_loss(*args, **kwargs):  # the switch as the op reads it (on a GPU it picks the kernel's sum)
        standalone.append(settings.deterministic_enabled())
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(ops, "indexer_kl_loss", indexer_kl_loss)
    config = tiny_config(dsa_indexer_loss_coeff=0.5, deterministic_mode=deterministic_mode,
                         dsa_indexer_use_sparse_loss=sparse_loss)
    torch.manual_seed(0)
    model = _gpt(config, get_dsa_layer_spec(config, model="glm5"))
    for m in model.modules():
        if isinstance(m, DSAttention):
            m.fuse_indexer_loss = fused
    tok, pos = _tokens(3)
    model(tok, pos, None).float().square().mean().backward()
    assert seen and all(v == deterministic_mode for v in seen)
    assert bool(standalone) != (sparse_loss and fused) and all(v == deterministic_mode for v in standalone)
