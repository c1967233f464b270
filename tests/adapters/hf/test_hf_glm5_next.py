"""GLM-5.3 (glm5_next) through the sparse path, against transformers' eager path (fp32, CPU).

In eager mode the glm5_next indexer's top-k (pools of ``index_kpool`` keys plus the incomplete tail
pool) becomes a dense [B, 1, S, T] mask. Under dsa_tilelang the indexer scores the pools through
``indexer_topk`` and the attention gets the selected key columns (``TopkSelection``) for
``sparse_mla``. The tiny config has pools of 2 keys, 2 pools per query, a shared-top-k layer and a
linear-attention layer; the pool gate / position embedding start random (they start constant), so
the compression matters.
"""

import inspect

import pytest
import torch

from dsa_plugins.adapters.hf import tiny

MODEL = "glm5_next"

if not tiny.available(MODEL):
    pytest.skip(f"{MODEL} is not in transformers {__import__('transformers').__version__}", allow_module_level=True)


def _randomise_pools(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Glm5NextTextIndexer":
                m.index_kpool_compress_gate.copy_(torch.randn(m.index_kpool_compress_gate.shape, generator=g) * 0.5)
                m.index_kpool_compress_ape.copy_(torch.randn(m.index_kpool_compress_ape.shape, generator=g))
    return model


def _model(seed=0, **overrides):
    return _randomise_pools(tiny.tiny_model(MODEL, seed=seed, **overrides), seed)


def _lm(seed=0):
    """Glm5NextForConditionalGeneration (the only causal LM of glm5_next) with a one-block vision tower."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                  projection_intermediate_size=64, patch_size=4, image_size=16, temporal_patch_size=1)
    config = Glm5NextConfig(text_config=tiny.tiny_config(MODEL).to_dict(), vision_config=vision)
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration._from_config(config, attn_implementation="eager").eval()
    return _randomise_pools(model, seed)


def _run(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    return model(ids, attention_mask=mask, use_cache=False, **kw).last_hidden_state


def _modeling():
    from transformers.models.glm5_next import modeling_glm5_next as m

    return m


@pytest.mark.parametrize("seq_len,pad", [(14, 3), (9, 4), (16, 0)])
def test_forward_matches_eager(registered, make_batch, seq_len, pad):
    model = _model()
    ids, mask = make_batch(seed=seq_len, seq_len=seq_len, pad=pad)
    with torch.no_grad():
        ref = _run(model, "eager", ids, mask)
        out = _run(model, "dsa_tilelang", ids, mask)
    assert torch.isfinite(out).all(), "fully masked (left-padding) rows must not give NaN"
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=2e-5)


def test_topk_matters(registered, make_batch):
    """Sanity of the comparisons: the tiny index_topk makes sparse attention differ from dense."""
    ids, mask = make_batch()
    with torch.no_grad():
        a = _run(_model(), "dsa_tilelang", ids, mask)
        b = _run(_model(index_topk=64), "dsa_tilelang", ids, mask)
    assert (a - b)[mask.bool()].abs().max() > 1e-3


def test_gradients_match_eager(registered, make_batch):
    model = _model().train()
    ids, mask = make_batch(seed=1, seq_len=12, pad=2)
    grads = {}
    for impl in ("eager", "dsa_tilelang"):
        model.zero_grad()
        out = _run(model, impl, ids, mask)
        (out[mask.bool()] ** 2).mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["dsa_tilelang"].keys()
    assert any("kv_b_proj" in n for n in grads["eager"])
    for name, ref in grads["eager"].items():
        torch.testing.assert_close(grads["dsa_tilelang"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


def test_chunked_prefill_with_cache_matches_eager(registered, make_batch):
    """A second multi-token forward on top of the cache (queries in the middle of the key axis)."""
    from transformers import DynamicCache

    model = _model()
    ids, mask = make_batch(seed=6, seq_len=15, pad=3)
    out = {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :9], attention_mask=mask[:, :9], past_key_values=cache, use_cache=True)
            out[impl] = model(ids[:, 9:], attention_mask=mask, past_key_values=cache, use_cache=True).last_hidden_state
    torch.testing.assert_close(out["dsa_tilelang"], out["eager"], rtol=1e-5, atol=2e-5)


def test_greedy_generate_matches_eager(registered, make_batch, greedy_matches_eager):
    """Batch 2 with left padding: prefill, then decode steps through the indexer cache."""
    model = _lm()
    ids, mask = make_batch(seed=2)
    greedy_matches_eager(model, ids, mask, config_of=lambda m: m.config.text_config)


def test_model_built_before_and_after_registration(make_batch):
    from dsa_plugins import hf

    hf.unregister()
    before = _model()
    with pytest.raises(ValueError, match="dsa_tilelang"):
        before.set_attn_implementation("dsa_tilelang")
    hf.register()
    try:
        after = _model(attn_implementation="dsa_tilelang")
        before.set_attn_implementation("dsa_tilelang")
        ids, mask = make_batch()
        with torch.no_grad():
            a = before(ids, attention_mask=mask).last_hidden_state
            b = after(ids, attention_mask=mask).last_hidden_state
            before.set_attn_implementation("eager")
            ref = before(ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=2e-5)
    finally:
        hf.unregister()


def test_prefill_builds_no_dense_mask(registered, make_batch, monkeypatch):
    """No [B, S, T] visibility / mask tensors: the attention gets the selection, not a mask."""
    from dsa_plugins.adapters.hf import attention
    from dsa_plugins.adapters.hf.masks import TopkSelection

    m = _modeling()

    def forbidden(*args, **kwargs):
        raise AssertionError("an O(S*T) helper of the eager indexer ran")

    monkeypatch.setattr(m.Glm5NextTextIndexer, "get_visible_tokens", forbidden)
    monkeypatch.setattr(m.Glm5NextTextIndexer, "append_visible_tail", forbidden)
    seen = []
    real = attention.absorbed_mla_forward

    def spy(module, query, latent, attention_mask, *args, **kwargs):
        seen.append(type(attention_mask))
        return real(module, query, latent, attention_mask, *args, **kwargs)

    monkeypatch.setattr(attention, "absorbed_mla_forward", spy)
    model = _model(attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert seen == [TopkSelection] * 3  # the three indexed-attention layers


def _indexer_inputs(model, B, S, padding, seed=3):
    indexer = next(m for m in model.modules() if type(m).__name__ == "Glm5NextTextIndexer")
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, model.config.hidden_size, generator=g)
    q_resid = torch.randn(B, S, model.config.q_lora_rank, generator=g)
    return indexer, dict(hidden_states=hidden, q_resid=q_resid, attention_mask=padding, past_key_values=None)


@pytest.mark.parametrize(
    "overrides", [{}, dict(index_kpool=4, index_topk=8), dict(index_kpool_always_select_tail=False), dict(index_kpool=1)]
)
def test_indexer_selects_what_hf_selects(registered, overrides):
    """The patched indexer picks the same key sets as transformers' own (holes in the padding included)."""
    from dsa_plugins.patches import original_attribute

    model = _model(**overrides)
    B, S = 3, 23
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[1, :5] = False  # left padding
    padding[2, 7:9] = False  # a hole
    indexer, args = _indexer_inputs(model, B, S, padding)
    original = original_attribute(type(indexer), "forward")
    model.set_attn_implementation("dsa_tilelang")
    with torch.no_grad():
        ref = original(indexer, **args)
        new = type(indexer).forward(indexer, **args)
    assert new.dtype == torch.int32 and new.shape == ref.shape
    for b in range(B):
        for s in range(S):
            want = {i for i in ref[b, s].tolist() if i >= 0}
            got = {i for i in new[b, s].tolist() if i >= 0}  # with holes the tail may repeat a pool's key,
            assert got == want, (b, s, sorted(got), sorted(want))  # in eager too: the mask step dedups


def test_selection_is_a_set():
    """Out-of-range and repeated columns go to -1 (the eager mask counts a column once)."""
    from dsa_plugins.adapters.hf.masks import unique_key_columns

    idx = torch.tensor([[[3, 1, 3, -1, 7, 1, 0]]])
    out = unique_key_columns(idx, kv_length=5)
    assert out.dtype == torch.int32
    assert sorted(i for i in out[0, 0].tolist() if i >= 0) == [0, 1, 3]


def test_rows_without_keys_give_zeros(registered):
    """A query row with no selected key (padding query) gives zeros and zero gradients, never NaN."""
    from dsa_plugins.adapters.hf.attention import dsa_attention_forward
    from dsa_plugins.adapters.hf.masks import TopkSelection

    model = _model(attn_implementation="dsa_tilelang")
    attn = model.layers[0].self_attn
    B, H, S, T = 2, attn.num_heads, 4, 6
    q = torch.randn(B, H, S, attn.qk_head_dim, requires_grad=True)
    latent = torch.randn(B, 1, T, attn.kv_lora_rank, requires_grad=True)
    idx = torch.randint(0, T, (B, S, 3), dtype=torch.int32)
    idx[1, :2] = -1
    out, _ = dsa_attention_forward(attn, q, latent, latent.new_empty(B, 1, T, 0), TopkSelection(idx), scaling=0.25)
    assert out.shape == (B, S, H, attn.v_head_dim)
    assert torch.isfinite(out).all() and out[1, :2].abs().max() == 0
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and q.grad[1, :, :2].abs().max() == 0


def test_patch_points_and_status(registered):
    from dsa_plugins.adapters.hf.models import patch_model, supported_models
    from dsa_plugins.patches import applied_keys

    m = _modeling()
    assert "hf.glm5_next" in applied_keys()
    assert supported_models()[MODEL].startswith("patched")
    for cls, name in ((m.Glm5NextTextAttention, "expand_kv"), (m.Glm5NextTextAttention, "build_attention_mask_from_topk"),
                      (m.Glm5NextTextIndexer, "forward")):
        assert inspect.unwrap(cls.__dict__[name]) is not cls.__dict__[name], (cls, name)
    patched = {name: m.Glm5NextTextAttention.__dict__[name] for name in ("expand_kv", "build_attention_mask_from_topk")}
    patch_model(MODEL)  # a second application is a no-op
    assert applied_keys().count("hf.glm5_next") == 1
    assert all(m.Glm5NextTextAttention.__dict__[n] is fn for n, fn in patched.items())
    registered.unregister()  # reverted: the originals are back
    try:
        assert "hf.glm5_next" not in applied_keys()
        assert all(m.Glm5NextTextAttention.__dict__[n] is inspect.unwrap(fn) for n, fn in patched.items())
    finally:
        registered.register()


def test_gradient_checkpointing(registered, make_batch):
    """Recomputation re-runs the patched indexer; the shared-top-k layer still gets its indices."""
    model = _model().train()
    ids, mask = make_batch(seed=4, seq_len=12, pad=2)
    grads = {}
    for impl, checkpointing in (("eager", False), ("dsa_tilelang", True)):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        out = _run(model, impl, ids, mask)
        (out[mask.bool()] ** 2).mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, ref in grads["eager"].items():
        torch.testing.assert_close(grads["dsa_tilelang"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


def test_vision_tower_falls_back_to_sdpa(registered):
    """The vision tower receives the same attn_implementation; with no indices it runs SDPA."""
    model = _lm()
    vision = model.model.visual
    c = vision.config
    pixels = torch.randn(16, c.in_channels * c.temporal_patch_size * c.patch_size**2,
                         generator=torch.Generator().manual_seed(7))
    out = {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        assert vision.config._attn_implementation == impl
        with torch.no_grad():
            out[impl] = vision(pixels, grid_thw=torch.tensor([[1, 4, 4]])).pooler_output
    torch.testing.assert_close(out["dsa_tilelang"], out["eager"], rtol=1e-5, atol=2e-5)


def test_no_tail_config_warns(registered, make_batch, caplog):
    """index_kpool_always_select_tail=False leaves the first tokens without keys: zeros, and a warning."""
    import logging

    model = _model(index_kpool_always_select_tail=False, attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with caplog.at_level(logging.WARNING, logger="dsa_plugins"), torch.no_grad():
        out = model(ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out).all()
    assert "index_kpool_always_select_tail=False" in caplog.text


def _gpu_case(device: str, dtype: torch.dtype):
    """A glm5_next text model with 64 heads over a 512-wide NoPE latent (the kernels' 512/512 without sink), 32
    index heads of 128, top-k 64 in pools of 2, and a batch of distinct tokens (NoPE keys depend on the token
    alone: a repeated token would tie two pools' scores exactly, and the paths may break the tie differently)."""
    model = _model(vocab_size=512, **tiny.kernel_sizes(MODEL)).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(509, generator=g)[:256] + 3 for _ in range(2)])
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding
    return model, ids.to(device), mask.to(device)


@pytest.mark.gpu
def test_gpu_bf16_kernels_match_eager(registered, monkeypatch):
    """bf16 on a Hopper GPU through the kernels (backend forced): the pooled selection and sparse_mla at 512/512."""
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    model, ids, mask = _gpu_case("cuda", torch.bfloat16)
    with torch.no_grad():
        a = _run(model, "eager", ids, mask).float()
        b = _run(model, "dsa_tilelang", ids, mask).float()
    valid = mask.bool()
    assert torch.isfinite(b).all()
    err = (a - b)[valid].abs().max().item()
    assert err < 0.05 * a[valid].abs().max().item() + 0.05, err
