"""The opt-in fp8 index cache (``dsa_plugins.hf.enable_fp8_index_cache``): the indexer scored in e4m3, the
cache holding the keys' bytes and per-key scales in step with transformers' own cache bookkeeping."""

import inspect

import pytest
import torch

from dsa_plugins.adapters.hf import tiny
from dsa_plugins.reference.indexer import quantize_fp8_rows


def _model(model_type="glm_moe_dsa", **overrides):
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in this transformers")
    model = tiny.tiny_model(model_type, **overrides)
    model.set_attn_implementation("dsa_tilelang")
    return model


def _cache_kw(model, cache):
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _indexed_layer(cache):
    return next(layer for layer in cache.layers if getattr(layer, "is_indexer_initialized", False))


def test_the_cache_holds_the_quantised_keys_and_the_indexer_scores_them(registered, make_batch, monkeypatch):
    """With fp8 on, the cache's indexer keys are the e4m3 bytes of the keys the bf16 path caches (scales
    amax / 448 per key), and the indexer op gets fp8 q / k with those scales and weights that carry the query
    scales: its scores are the unquantised scores to fp8's precision."""
    from transformers import DynamicCache

    from dsa_plugins.adapters.hf import indexer as hf_indexer
    from dsa_plugins.reference.indexer import indexer_scores

    model = _model()
    ids, mask = make_batch(seed=5)
    with torch.no_grad():
        plain = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, **_cache_kw(model, plain))
        calls, inputs = [], []
        original, quantize = hf_indexer.ops.indexer_topk, hf_indexer.quantize_index_inputs

        def spy(q, k, w, topk, start, end, **kw):
            calls.append((q.dtype, k.dtype, kw.get("index_k_scale")))
            return original(q, k, w, topk, start, end, **kw)

        def spy_quantize(q, k, w):
            out = quantize(q, k, w)
            inputs.append(((q, k, w), out))
            return out

        monkeypatch.setattr(hf_indexer.ops, "indexer_topk", spy)
        monkeypatch.setattr(hf_indexer, "quantize_index_inputs", spy_quantize)
        assert registered.enable_fp8_index_cache(model) >= 1
        fp8 = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, **_cache_kw(model, fp8))
    keys = _indexed_layer(plain).indexer_keys
    layer = _indexed_layer(fp8)
    assert layer.indexer_keys.dtype == torch.uint8 and layer.indexer_keys.shape == keys.shape
    want8, want_scale = quantize_fp8_rows(keys)
    assert torch.equal(layer.indexer_keys, want8.view(torch.uint8))
    torch.testing.assert_close(layer._dsa_index_key_scale, want_scale, rtol=0, atol=0)
    assert calls and all(q == k == torch.float8_e4m3fn and s is not None for q, k, s in calls)
    for (q, k, w), (q8, k8, k_scale, w8) in inputs:  # scores of batch entry 0, all its keys
        want = indexer_scores(q[0], k[0], w[0])
        got = indexer_scores(q8[0], k8[0], w8[0], index_k_scale=k_scale[0])
        torch.testing.assert_close(got, want, rtol=0.15, atol=0.1 * float(want.abs().max()))
    assert registered.disable_fp8_index_cache(model) == len(calls)


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_fp8_generation_static_dynamic_and_compiled_agree(registered, make_batch, model_type):
    """Left-padded greedy generation with fp8 index keys: a dynamic cache, a static cache and the static cache
    under torch.compile(fullgraph) (no graph break, no host sync in the fp8 path) give the same tokens and the
    same logits at every step (fp32: one cache's keys or scales out of place moves them)."""
    model = _model(model_type)
    registered.enable_fp8_index_cache(model)
    ids, mask = make_batch(seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(ids, **kw)
        try:
            static = model.generate(ids, cache_implementation="static", **kw)
        except (KeyError, NotImplementedError, ValueError) as e:
            pytest.skip(f"transformers has no static cache for {model_type}: {e}")
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        try:
            compiled = model.generate(ids, cache_implementation="static", **kw)
        finally:
            del model.forward
            torch._dynamo.reset()
    assert torch.equal(static.sequences, dynamic.sequences)
    assert torch.equal(compiled.sequences, static.sequences)
    for run in (static, compiled):
        for got, want in zip(run.logits, dynamic.logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_scales_follow_batch_moves_and_crops(registered, make_batch):
    """Beam reordering, batch expansion and selection move the scales with the keys; a dynamic cache's crop
    drops the scales past its keys at the next update."""
    from transformers import DynamicCache, StaticCache

    model = _model()
    registered.enable_fp8_index_cache(model)
    ids, mask = make_batch(seed=7, batch_size=3)
    with torch.no_grad():
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=32)):
            model(ids, attention_mask=mask, **_cache_kw(model, cache))
            layer = _indexed_layer(cache)
            before = layer._dsa_index_key_scale.clone()
            order = torch.tensor([2, 0, 1])
            cache.reorder_cache(order)
            assert torch.equal(layer._dsa_index_key_scale, before[order])
            if isinstance(cache, DynamicCache):
                cache.batch_repeat_interleave(2)
                assert torch.equal(layer._dsa_index_key_scale, before[order].repeat_interleave(2, dim=0))
                cache.batch_select_indices(torch.tensor([0, 2, 4]))
                assert torch.equal(layer._dsa_index_key_scale, before[order])
                cache.crop(-4)  # the last 4 tokens
            step = torch.full((3, 1), 5)
            model(step, attention_mask=torch.ones(3, cache.get_seq_length() + 1, dtype=mask.dtype),
                  **_cache_kw(model, cache))
            scales = layer._dsa_index_key_scale
            assert scales.shape == layer.indexer_keys.shape[:2]
            if isinstance(cache, DynamicCache):
                assert torch.equal(scales[:, : ids.shape[1] - 4], before[order][:, : ids.shape[1] - 4])


def test_refusals_name_what_to_do(registered, make_batch):
    """Not under dsa_tilelang, a cache holding index keys in the other format (either way), and the indexer loss
    with fp8 are each refused with a message that says what to change."""
    from transformers import DynamicCache

    model = _model()
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attn_implementation"):
        registered.enable_fp8_index_cache(model)
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch(seed=8)
    with torch.no_grad():
        for fp8_first in (False, True):
            (registered.enable_fp8_index_cache if fp8_first else registered.disable_fp8_index_cache)(model)
            cache = DynamicCache(config=model.config)
            model(ids, attention_mask=mask, **_cache_kw(model, cache))
            (registered.disable_fp8_index_cache if fp8_first else registered.enable_fp8_index_cache)(model)
            with pytest.raises(ValueError, match="between generations"):
                model(ids[:, -1:], **_cache_kw(model, cache))
    registered.enable_fp8_index_cache(model)
    handle = registered.enable_indexer_loss(model, weight=0.1)
    model.train()
    with pytest.raises(ValueError, match="disable_fp8_index_cache"):
        model(ids, attention_mask=mask, use_cache=False)
    handle.remove()


def test_a_reset_static_cache_changes_format(registered, make_batch):
    """generate reuses its static cache after a reset: an empty static layer takes the new format, so turning
    fp8 on or off between generations gives what a new cache gives."""
    from transformers import StaticCache

    model = _model()
    ids, mask = make_batch(seed=10)
    outs, cache = {}, StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        for fp8 in (False, True, False):
            (registered.enable_fp8_index_cache if fp8 else registered.disable_fp8_index_cache)(model)
            for reuse in (True, False):  # the last format's cache after a reset, then a new one
                if reuse:
                    cache.reset()
                else:
                    cache = StaticCache(config=model.config, max_cache_len=32)
                out = model(ids, attention_mask=mask, **_cache_kw(model, cache)).logits
                layer = _indexed_layer(cache)
                assert (layer.indexer_keys.dtype == torch.uint8) == fp8
                outs.setdefault(fp8, out)
                torch.testing.assert_close(out, outs[fp8], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_index_cache_under_cuda_graphs(registered, gpu_generation, monkeypatch):
    """bf16 model, fp8 index keys through the TileLang kernels: the static cache's compiled (CUDA-graph) decode
    gives the first new token and the logits of the prefill and first decode step of the uncompiled dynamic-cache
    run with fp8 keys (later tokens may part: inductor's projections round differently)."""
    from transformers import CompileConfig

    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    model, ids, kw = gpu_generation("glm_moe_dsa")
    torch._dynamo.reset()
    with torch.no_grad():
        registered.enable_fp8_index_cache(model)
        dynamic = model.generate(ids, **kw)
        static = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(fullgraph=True), **kw)
    torch._dynamo.reset()
    first = ids.shape[1]
    assert torch.equal(static.sequences[:, first], dynamic.sequences[:, first])
    for step in (0, 1):
        a, b = dynamic.logits[step].float(), static.logits[step].float()
        assert torch.isfinite(b).all()
        assert (a - b).abs().max().item() < 0.05 * a.abs().max().item() + 0.05, step
