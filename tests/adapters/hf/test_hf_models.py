"""Every supported DSA model: the dsa_tilelang path against transformers' eager path (fp32, CPU).

The torch reference of the sparse ops is exact math, so logits agree to rounding (the absorbed MLA
differs from the expanded K/V only by the order of the products). Tiny configs keep index_topk below
the sequence length, so the top-k selection matters. The tiny configs have no padding token
(pad_token_id=None): a zero embedding makes exactly tied indexer scores, where the two paths may
break ties differently.
"""

import pytest
import torch

from dsa_plugins.adapters.hf import tiny
from dsa_plugins.adapters.hf.constants import V32_FAMILY

MODELS = list(tiny.SPECS)
CAUSAL = [m for m in MODELS if tiny.is_causal_lm(m)]


def _require(model_type):
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in transformers {__import__('transformers').__version__}")


def _run(model, impl, ids, mask, **kw):
    model.set_attn_implementation(impl)
    return model(ids, attention_mask=mask, use_cache=False, **kw)


@pytest.mark.parametrize("model_type", MODELS)
def test_forward_matches_eager(registered, model_type, make_batch, output_of):
    _require(model_type)
    model = tiny.tiny_model(model_type)
    ids, mask = make_batch()
    with torch.no_grad():
        ref = output_of(_run(model, "eager", ids, mask))
        out = output_of(_run(model, "dsa_tilelang", ids, mask))
    assert torch.isfinite(out).all(), "fully masked (left-padding) rows must not give NaN"
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("model_type", MODELS)
def test_gradients_match_eager(registered, model_type, make_batch, output_of):
    _require(model_type)
    model = tiny.tiny_model(model_type).train()
    ids, mask = make_batch(seed=1, seq_len=12, pad=2)
    grads = {}
    for impl in ("eager", "dsa_tilelang"):
        model.zero_grad()
        out = output_of(_run(model, impl, ids, mask))
        (out[mask.bool()].float() ** 2).mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["dsa_tilelang"].keys()
    for name, ref in grads["eager"].items():
        torch.testing.assert_close(grads["dsa_tilelang"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v4"])
def test_gradient_checkpointing(registered, model_type, make_batch, output_of):
    """Recomputation re-runs the patched indexer / the captured V4 state in the right order."""
    _require(model_type)
    model = tiny.tiny_model(model_type).train()
    ids, mask = make_batch(seed=4, seq_len=12, pad=2)
    grads = {}
    for impl, checkpointing in (("eager", False), ("dsa_tilelang", True)):
        model.set_attn_implementation(impl)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        out = output_of(_run(model, impl, ids, mask))
        (out[mask.bool()] ** 2).mean().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name, ref in grads["eager"].items():
        torch.testing.assert_close(grads["dsa_tilelang"][name], ref, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("model_type", CAUSAL)
def test_greedy_generate_matches_eager(registered, model_type, make_batch, greedy_matches_eager):
    _require(model_type)
    model = tiny.tiny_model(model_type)
    ids, mask = make_batch(seed=2)
    greedy_matches_eager(model, ids, mask)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_greedy_generate_with_a_padding_gap_matches_eager(registered, model_type, greedy_matches_eager):
    """A 2D attention mask with a gap between tokens (batch 1 and 2): every decode step and the prefill take
    each row's top-k among the keys it may see, so the tokens and logits are eager's."""
    _require(model_type)
    model = tiny.tiny_model(model_type)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[0, 5:8] = 0
    mask[1, :3] = 0
    greedy_matches_eager(model, ids[:1], mask[:1])
    greedy_matches_eager(model, ids, mask)


@pytest.mark.parametrize("cache", [None, "static"])
def test_left_padding_never_takes_the_dense_gap_path(registered, make_batch, monkeypatch, cache):
    """Left padding leaves no gap, also with a static cache (whose columns past the tokens so far are masked:
    they lie after every row's window): prefill and decode steps keep the windowed kernel. A real gap takes the
    dense path (the spy sees it), so the check can fail."""
    from dsa_plugins.adapters.hf import indexer as hf_indexer

    dense_calls = []
    original = hf_indexer._topk_among_allowed

    def spy(*args, **kwargs):
        dense_calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(hf_indexer, "_topk_among_allowed", spy)
    model = tiny.tiny_model("glm_moe_dsa")
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch(seed=9)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=2, cache_implementation=cache)
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, **kw)
        assert dense_calls == []
        gap = mask.clone()
        gap[0, 4:6] = 0
        model.generate(ids, attention_mask=gap, **kw)
    assert dense_calls


def test_the_v32_family_list_is_the_absorbed_entries():
    """The family the indexer loss and the fp8 index cache name in their errors is the models table's absorbed path."""
    from dsa_plugins.adapters.hf.models import _ABSORBED
    from dsa_plugins.adapters.hf.models import MODELS as TABLE

    absorbed_model_types = [t for t, entry in TABLE.items() if entry.path.startswith(_ABSORBED)]
    assert list(V32_FAMILY) == absorbed_model_types


_SPARSE_OPS = ("indexer_topk", "sparse_mla")


def _spy_sparse_ops(monkeypatch) -> list:
    """Wraps ops.indexer_topk and ops.sparse_mla; returns the list their calls append (op name, q dtype, k dtype) to."""
    from dsa_plugins import ops

    calls = []
    for name in _SPARSE_OPS:
        def spy(q, k, *a, _n=name, _f=getattr(ops, name), **kw):
            calls.append((_n, q.dtype, k.dtype))
            return _f(q, k, *a, **kw)

        monkeypatch.setattr(ops, name, spy)
    return calls


@pytest.mark.parametrize("model_type", [m for m in MODELS if m not in ("deepseek_v4", "glm5_next")])
def test_absorbed_models_run_the_sparse_ops(registered, model_type, make_batch, monkeypatch):
    """Each absorbed-MLA model's dsa_tilelang forward goes through ops.indexer_topk and ops.sparse_mla once per
    attention layer that selects / attends (so a model whose patches were not applied, and which would match eager
    through a dense fallback, fails here)."""
    _require(model_type)
    seen = _spy_sparse_ops(monkeypatch)
    model = tiny.tiny_model(model_type)
    ids, mask = make_batch()
    with torch.no_grad():
        _run(model, "dsa_tilelang", ids, mask)
    calls = {name: sum(1 for op, *_ in seen if op == name) for name in _SPARSE_OPS}
    config = model.config
    layers = [t for t in getattr(config, "layer_types", None) or ["indexed_attention"] * config.num_hidden_layers
              if "sliding" not in t]
    full = [t for t in getattr(config, "indexer_types", None) or ["full"] * len(layers) if t == "full"]
    assert calls == {"indexer_topk": len(full), "sparse_mla": len(layers)}, calls


@pytest.mark.parametrize("model_type", V32_FAMILY)
def test_bf16_models_give_the_sparse_ops_bf16(registered, model_type, make_batch, monkeypatch):
    """In a bf16 model, q and k reach ops.indexer_topk and ops.sparse_mla in bf16, the kernels' dtype, and the index
    keys are cached so (dots3_note's fp32 cos / sin promoted its indexer's rope slice, which the kernels refuse:
    found by the GPU test; its own eager path caches them in fp32)."""
    _require(model_type)
    calls = _spy_sparse_ops(monkeypatch)
    model = tiny.tiny_model(model_type).to(torch.bfloat16)
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch()
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).past_key_values
    seen = {name: {(q, k) for op, q, k in calls if op == name} for name in _SPARSE_OPS}
    assert seen == {name: {(torch.bfloat16, torch.bfloat16)} for name in seen}, seen
    # the index keys are cached in the dtype the kernel reads (not cast whole at every step)
    keys = [layer.indexer_keys for layer in cache.layers if getattr(layer, "indexer_keys", None) is not None]
    assert keys and {k.dtype for k in keys} == {torch.bfloat16}


def test_topk_matters_in_tiny_configs(registered, make_batch, output_of):
    """Sanity of the tests above: with the tiny index_topk, sparse attention differs from dense."""
    ids, mask = make_batch()
    sparse = tiny.tiny_model("glm_moe_dsa")
    dense = tiny.tiny_model("glm_moe_dsa", index_topk=4096)
    with torch.no_grad():
        a = output_of(_run(sparse, "dsa_tilelang", ids, mask))
        b = output_of(_run(dense, "dsa_tilelang", ids, mask))
    assert (a - b)[mask.bool()].abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32", "deepseek_v4"])
def test_prefill_builds_no_dense_mask(registered, model_type, make_batch, monkeypatch):
    """Causal / sliding masks with left padding stay lazy: nothing materialises [B, 1, S, T]."""
    _require(model_type)
    from dsa_plugins.adapters.hf.masks import LazyMask

    def forbidden(self):
        raise AssertionError("the dense mask was materialised")

    monkeypatch.setattr(LazyMask, "dense", forbidden)
    model = tiny.tiny_model(model_type, attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with torch.no_grad():
        model(ids, attention_mask=mask)


@pytest.mark.parametrize("gap", [False, True], ids=["left_padding", "padding_gap"])
@pytest.mark.parametrize("model_type", V32_FAMILY)
def test_indexer_selects_what_hf_selects(registered, model_type, gap):
    """The patched indexer (indexer_topk) picks the same key sets as transformers' own indexer, also where the
    padding leaves a gap inside a row (its top-k taken among the allowed keys, not masked after)."""
    _require(model_type)
    from dsa_plugins.adapters.hf.masks import dsa_mask
    from dsa_plugins.patches import original_attribute

    model = tiny.tiny_model(model_type)
    indexer = next(m for m in model.modules() if type(m).__name__.endswith("Indexer"))
    original = original_attribute(type(indexer), "forward")
    B, S = 2, 16
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, S, model.config.hidden_size, generator=g)
    q_resid = torch.randn(B, S, getattr(indexer, "q_lora_rank", None) or 1, generator=g)
    position_ids = torch.arange(S)[None].expand(B, -1)
    dim = indexer.qk_rope_head_dim
    freqs = position_ids[..., None].float() / (100.0 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([freqs, freqs], -1)
    pos_emb = (emb.cos(), emb.sin())
    padding = torch.ones(B, S, dtype=torch.bool)
    padding[1, :4] = False
    if gap:
        padding[0, 5:8] = False  # rows 8.. of sequence 0 see keys 0-4 and 8..
    lazy = dsa_mask(B, S, S, attention_mask=padding)
    dense = lazy.dense()[:, 0]
    params = list(__import__("inspect").signature(original).parameters)
    cache_name = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.24
    args = dict(hidden_states=hidden, position_embeddings=pos_emb, position_ids=position_ids, **{cache_name: None})
    if "q_resid" in params:
        args["q_resid"] = q_resid
    with torch.no_grad():
        ref = original(indexer, attention_mask=dense, **args)
        new = type(indexer).forward(indexer, attention_mask=lazy, **args)
    for b in range(B):
        for s in range(S):
            if not padding[b, s]:
                continue
            want = {i for i in ref[b, s].tolist() if dense[b, s, i]}
            got = {i for i in new[b, s].tolist() if i >= 0}
            assert got == want, (b, s)


def test_vision_like_module_falls_back_to_sdpa(registered):
    """A module with no indices and full K/V (a vision or audio tower) goes through SDPA."""
    from dsa_plugins.adapters.hf.attention import dsa_attention_forward
    from dsa_plugins.adapters.hf.masks import dsa_mask

    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = dsa_mask(2, 6, 6, mask_function=lambda b, h, qi, ki: torch.ones((), dtype=torch.bool))
    out, _ = dsa_attention_forward(module, q, k, v, None, scaling=8**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=8**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    assert mask.shape == (2, 1, 6, 6)


def test_multimodal_tower_falls_back_in_a_real_model(registered):
    """Mistral Large 4 with its (Pixtral) vision tower: the tower has no indices and runs SDPA."""
    _require("mistral_large4")
    from transformers import MistralLarge4Config, MistralLarge4ForConditionalGeneration

    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=4, image_size=16, hidden_act="silu", head_dim=16)
    config = MistralLarge4Config(text_config=tiny.tiny_config("mistral_large4").to_dict(), vision_config=vision,
                                 image_token_index=10, spatial_merge_size=2)
    torch.manual_seed(0)
    model = MistralLarge4ForConditionalGeneration(config).eval()
    pixels = torch.randn(1, 3, 16, 16)
    ids = torch.cat([torch.tensor([[1]]), torch.full((1, 4), 10), torch.randint(11, 128, (1, 8))], 1)
    out = {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        assert model.model.vision_tower.config._attn_implementation == impl
        with torch.no_grad():
            out[impl] = model(input_ids=ids, pixel_values=pixels, image_sizes=torch.tensor([[16, 16]])).logits
    torch.testing.assert_close(out["dsa_tilelang"], out["eager"], rtol=1e-5, atol=2e-5)


def test_hy_v4_vl_with_an_image_matches_eager(registered):
    """Hy V4's vision-language model with one image (4 x 4 patches, merged 2 x 2, a newline token per row): the text
    layers run the sparse ops, the vision tower (no indices) SDPA; the logits are eager's, and so are the greedy
    tokens with the dynamic and the static cache."""
    _require("hy_v4_vl")
    from transformers import HYV4VLConfig, HYV4VLForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  spatial_merge_size=2, out_hidden_size=64, max_image_size=64)
    config = HYV4VLConfig(text_config=tiny.tiny_config("hy_v4_vl").to_dict(), vision_config=vision,
                          image_token_id=10, video_token_id=11)
    torch.manual_seed(0)
    model = HYV4VLForConditionalGeneration(config).eval()
    g = torch.Generator().manual_seed(4)
    pixels = torch.randn(16, 3 * 4 * 4, generator=g)
    ids = torch.cat([torch.tensor([[1]]), torch.full((1, 2 * 3), 10), torch.randint(12, 128, (1, 8), generator=g)], 1)
    inputs = dict(pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]]), mm_token_type_ids=(ids == 10).int())
    out, tokens = {}, {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        assert model.model.vision_tower.config._attn_implementation == impl
        with torch.no_grad():
            out[impl] = model(input_ids=ids, **inputs).logits
            for cache in (None, "static"):  # greedy generation, transformers' dynamic cache and the fixed-size one
                tokens[impl, cache] = model.generate(ids, cache_implementation=cache, max_new_tokens=5,
                                                     min_new_tokens=5, do_sample=False, pad_token_id=2,
                                                     **inputs)[0, ids.shape[1]:]
    torch.testing.assert_close(out["dsa_tilelang"], out["eager"], rtol=1e-5, atol=2e-5)
    for cache in (None, "static"):
        assert torch.equal(tokens["dsa_tilelang", cache], tokens["eager", None]), cache


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v4"])
def test_model_built_before_and_after_registration(model_type, make_batch, output_of):
    _require(model_type)
    from dsa_plugins import hf

    hf.unregister()
    before = tiny.tiny_model(model_type)
    with pytest.raises(ValueError, match="dsa_tilelang"):
        before.set_attn_implementation("dsa_tilelang")
    hf.register()
    try:
        after = tiny.tiny_model(model_type, attn_implementation="dsa_tilelang")
        before.set_attn_implementation("dsa_tilelang")
        ids, mask = make_batch()
        with torch.no_grad():
            a = output_of(before(ids, attention_mask=mask))
            b = output_of(after(ids, attention_mask=mask))
        torch.testing.assert_close(a, b)
    finally:
        hf.unregister()


# every served model with rotary keys (glm5_next's NoPE keys depend on the token alone, so repeated tokens tie its
# pools' scores exactly and the two paths may pick different pools: its own file tests it)
@pytest.mark.gpu
@pytest.mark.parametrize("model_type", [*V32_FAMILY, "deepseek_v4"])
def test_gpu_bf16_kernels_match_eager(registered, model_type, make_batch, output_of, monkeypatch):
    """bf16 on a Hopper GPU through the TileLang kernels (backend forced), device_map="auto", at the released
    models' head sizes; greedy generation too where the tiny model is a causal LM."""
    _require(model_type)
    import tempfile

    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    cls = tiny.model_class(model_type)
    model = tiny.tiny_model(model_type, **tiny.kernel_sizes(model_type))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        ref = cls.from_pretrained(d, dtype=torch.bfloat16, device_map="auto", attn_implementation="eager")
        dsa = cls.from_pretrained(d, dtype=torch.bfloat16, device_map="auto", attn_implementation="dsa_tilelang")
    ids, mask = make_batch(seq_len=256, pad=17)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        try:
            a = output_of(ref(ids, attention_mask=mask)).float()
        except RuntimeError as exc:  # the reference itself: transformers 5.17's V4 mixes fp32 into bf16 layers
            if model_type == "deepseek_v4" and "dtype" in str(exc):
                pytest.skip(f"eager DeepSeek-V4 fails in bf16 in this transformers release: {exc}")
            raise
        b = output_of(dsa(ids, attention_mask=mask)).float()
    valid = mask.bool()
    assert torch.isfinite(b).all()
    err = (a - b)[valid].abs().max().item()
    assert err < 0.05 * a[valid].abs().max().item() + 0.05, err
    if not tiny.is_causal_lm(model_type):
        return
    with torch.no_grad():
        ga = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
        gb = dsa.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
    assert (ga == gb).float().mean() > 0.9


def test_v4_indexer_scores_through_indexer_topk(registered, make_batch, monkeypatch):
    """DeepSeek-V4's CSA indexer: no dense [B, S, H, T/4] scores, the fused top-k instead."""
    _require("deepseek_v4")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    from dsa_plugins import ops

    def dense_scores(*args, **kwargs):
        raise AssertionError("the dense indexer scorer ran")

    calls = []
    real = ops.indexer_topk
    monkeypatch.setattr(v4.DeepseekV4IndexerScorer, "forward", dense_scores)
    monkeypatch.setattr(ops, "indexer_topk", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=2)
    assert len(calls) == 3  # the CSA layer: prefill + 2 decode steps


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_packed_sequences_match_eager(registered, model_type, output_of):
    """Packed sequences (position_ids restart, no attention mask): keys never cross a boundary."""
    _require(model_type)
    model = tiny.tiny_model(model_type)
    ids = torch.randint(3, 128, (1, 15), generator=torch.Generator().manual_seed(5))
    position_ids = torch.cat([torch.arange(6), torch.arange(9)])[None]
    out = {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = output_of(model(ids, position_ids=position_ids, use_cache=False))
    torch.testing.assert_close(out["dsa_tilelang"], out["eager"], rtol=1e-5, atol=2e-5)


def test_indexer_call_binds_either_cache_name():
    """transformers 5.24 renamed the indexer's ``past_key_values`` to ``cache``: a caller using either
    name reaches the cache (a wrapper that read only one name ran generation without the key cache)."""
    from dsa_plugins.adapters.hf.indexer import indexer_binder, indexer_cache

    def new_style(self, hidden_states, cache=None):
        ...

    def old_style(self, hidden_states, past_key_values=None):
        ...

    marker = object()
    for fn in (new_style, old_style):
        bind = indexer_binder(fn)
        for name in ("cache", "past_key_values"):
            a = bind((None, 1), {name: marker})
            assert indexer_cache(a) is marker and a["hidden_states"] == 1
        assert indexer_cache(bind((None, 1), {})) is None


def test_call_binder_binds_as_inspect_does():
    """The binder the patches use under torch.compile agrees with ``inspect.Signature.bind`` and
    refuses what it refuses."""
    import inspect

    from dsa_plugins.adapters.hf.binding import CallBinder

    def fn(self, a, b=2, *, c=None, d=4):
        ...

    bind = CallBinder(fn)
    for args, kwargs in [((0, 1), {}), ((0, 1, 3), {"d": 5}), ((0,), {"a": 1, "c": 7})]:
        ref = inspect.signature(fn).bind(*args, **kwargs)
        ref.apply_defaults()
        assert bind(args, kwargs) == dict(ref.arguments)
    for args, kwargs, message in [((0,), {}, "missing the argument 'a'"), ((0, 1), {"a": 1}, "multiple values"),
                                  ((0, 1), {"e": 1}, "unexpected keyword argument 'e'"),
                                  ((0, 1, 2, 3), {}, "takes 3 positional arguments")]:  # c, d: keyword-only
        with pytest.raises(TypeError, match=message):
            bind(args, kwargs)

    def more(self, a, /, b=2, **extra):
        ...

    bind = CallBinder(more)
    for args, kwargs in [((0, 1), {"z": 3}), ((0, 1), {"a": 5})]:  # a is positional-only: "a" lands in **extra
        ref = inspect.signature(more).bind(*args, **kwargs)
        ref.apply_defaults()
        assert bind(args, kwargs) == dict(ref.arguments)


def test_output_attentions_is_refused_with_a_message(registered):
    """transformers returns an empty tuple of attentions for an implementation that gives none: the
    sparse path says it cannot serve the request instead."""
    model = tiny.tiny_model("glm_moe_dsa")
    model.set_attn_implementation("dsa_tilelang")
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(ids, output_attentions=True)
    assert model(ids).logits.isfinite().all()  # the plain call still runs
