"""Generation with transformers' static cache, eager and under ``torch.compile`` (fp32, CPU).

A static cache is what CUDA-graph decoding needs (fixed buffers, ``cache_implementation="static"``).
Under ``torch.compile(fullgraph=True)`` the decoder layers, the patched indexers and the sparse ops
(custom ops with fake implementations) must trace as one graph: a graph break fails the test. The
``aot_eager`` backend traces exactly as inductor does without generating code, so the suite stays
fast; the GPU benchmark (``benchmarks/bench_hf_decode.py``) runs inductor with CUDA graphs.
"""

import inspect

import pytest
import torch

from dsa_plugins.adapters.hf import tiny

CAUSAL = [m for m in tiny.SPECS if tiny.is_causal_lm(m)]


def _static_model(model_type, ids, mask):
    """The tiny model, or a skip when transformers itself cannot generate with a static cache for it."""
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in transformers {__import__('transformers').__version__}")
    model = tiny.tiny_model(model_type)
    try:
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=2,
                           cache_implementation="static")
    except (KeyError, NotImplementedError, ValueError) as e:  # e.g. DeepSeek-V4's compressed layers (5.24)
        pytest.skip(f"transformers has no static cache for {model_type} (eager fails too: {type(e).__name__}: {e})")
    return model


@pytest.mark.parametrize("model_type", CAUSAL)
def test_static_cache_generate_matches_eager(registered, model_type, make_batch, greedy_matches_eager):
    """Left-padded batch, static cache: the tokens and logits of eager attention with a dynamic cache.
    (The static cache hands the mask its length counter, which the layers advance in place: a mask
    that kept the counter instead of its value saw the wrong windows from the second step on.)"""
    ids, mask = make_batch(seed=2)
    model = _static_model(model_type, ids, mask)
    greedy_matches_eager(model, ids, mask, cache_implementation="static")


@pytest.mark.parametrize("model_type", CAUSAL)
def test_compiled_static_decode_is_one_graph(registered, model_type, make_batch, eager_and_compiled):
    """``torch.compile(fullgraph=True)`` over prefill and decode steps with a static cache: no graph
    break (it would raise), the same tokens as the uncompiled model, and one graph for the prefill and one for
    every decode step of the left-padded batch (generate makes the mask before the forward; a mask whose padding
    grew by a column each step was a new input shape per step: recompiled, and a CUDA graph recorded per step)."""
    ids, mask = make_batch(seed=3)
    model = _static_model(model_type, ids, mask)
    model.set_attn_implementation("dsa_tilelang")
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2, cache_implementation="static")
    ref, got, frames = eager_and_compiled(model, ids, lambda: kw)
    assert torch.equal(got, ref)
    assert frames == 2, f"{frames} compiles for a prefill and 4 decode steps"


def test_static_cache_keeps_the_latent_in_one_buffer(registered, make_batch, monkeypatch):
    """The static cache's two latent halves are views of one buffer, and the absorbed attention reads
    that buffer itself (no copy of the cache per decode step); a dynamic cache is left as it was."""
    from transformers import DynamicCache, StaticCache

    from dsa_plugins.adapters.hf import attention

    seen = []
    original = attention.absorbed_mla_forward

    def spy(module, query, latent, *args):
        seen.append(latent)
        return original(module, query, latent, *args)

    monkeypatch.setattr(attention, "absorbed_mla_forward", spy)
    model = tiny.tiny_model("glm_moe_dsa")
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch(seed=4)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24 renamed it
    static = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{name: static})
    layer = static.layers[0]
    if layer.values.shape[-1] == 0:  # transformers 5.17 caches the whole latent as keys: no halves to join
        pytest.skip("this transformers caches the MLA latent in keys alone (values [.., 0])")
    assert layer.keys.data_ptr() + layer.keys.shape[-1] * layer.keys.element_size() == layer.values.data_ptr()
    assert seen and seen[0].data_ptr() == layer.keys.data_ptr() and seen[0].shape[-2] == 32
    torch.testing.assert_close(seen[0][..., : layer.keys.shape[-1]], layer.keys)
    seen.clear()
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{name: dynamic})
    assert seen and seen[0].is_contiguous() and seen[0].data_ptr() != dynamic.layers[0].keys.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type,seq_len,pad", [("glm_moe_dsa", 200, 17), ("deepseek_v32", 200, 17),
                                                   ("glm_moe_dsa", 320, 200)])
def test_gpu_static_cache_decode_under_cuda_graphs(registered, model_type, seq_len, pad, gpu_generation,
                                                   static_graphs_match_dynamic, monkeypatch):
    """bf16 through the TileLang kernels: ``generate(cache_implementation="static")`` compiles its decode
    steps with CUDA graphs (fullgraph, so a graph break fails); the first new token and the logits of the
    prefill and the first graph-replayed step are those of the uncompiled model with a dynamic cache, on a
    left-padded batch (200 padding tokens: past int8, where a compiled argmax had wrapped the window's start)."""
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    model, ids, kw = gpu_generation(model_type, seq_len=seq_len, pad=pad)
    static_graphs_match_dynamic(model, ids, kw)
