"""DeepSeek-V4 with the package's fixed-size cache (``DsaV4StaticCache``): what generation under CUDA graphs needs.

transformers has no static cache for V4's compressed layers; under dsa_tilelang ``generate(cache_implementation=
"static")`` makes ours. It must give eager's tokens and logits, hold the same compressed entries as transformers'
dynamic cache for calls of any length and alignment, and trace as one graph per call shape (fp32, CPU, aot_eager).
"""

import inspect

import pytest
import torch

from dsa_plugins.adapters.hf import tiny

def _cache_kwarg(model) -> str:
    """The forward's cache parameter: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


pytestmark = pytest.mark.skipif(not tiny.available("deepseek_v4"), reason="deepseek_v4 is not in this transformers")


@pytest.mark.parametrize("seq_len,pad", [(14, 3), (1, 0), (5, 2), (17, 0)])
def test_static_cache_generate_matches_eager(registered, seq_len, pad, make_batch, greedy_matches_eager):
    """Left-padded and unpadded prompts shorter and longer than the window (4) and the compress rates (2, 4):
    the tokens and logits of eager attention with transformers' dynamic cache."""
    model = tiny.tiny_model("deepseek_v4")
    ids, mask = make_batch(seed=2, seq_len=seq_len, pad=pad)
    greedy_matches_eager(model, ids, mask, cache_implementation="static")


def test_generate_makes_the_fixed_cache_only_under_dsa_tilelang(registered, make_batch):
    from dsa_plugins.hf import DsaV4StaticCache

    model = tiny.tiny_model("deepseek_v4")
    ids, mask = make_batch(seed=1)
    model.set_attn_implementation("dsa_tilelang")
    arg = _cache_kwarg(model)
    made = model._prepare_static_cache(cache_implementation="static", batch_size=2, max_cache_len=40,
                                       prefill_chunk_size=None, model_kwargs={})
    assert isinstance(made, DsaV4StaticCache) and made.is_compileable and len(made.layers) == 3
    assert [layer.names for layer in made.layers] == [(), ("compressor", "indexer"), ("compressor",)]
    # another attention implementation reading our layout would be wrong: refused with the reason
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="serves attn_implementation='dsa_tilelang' only"), torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True, **{arg: DsaV4StaticCache(model.config, max_cache_len=40)})


def test_unregister_restores_transformers_static_cache(make_batch):
    from dsa_plugins import hf

    model_cls = tiny.model_class("deepseek_v4")
    hf.register()
    tiny.tiny_model("deepseek_v4")  # imports the modeling module: the patch applies
    assert "_prepare_static_cache" in model_cls.__dict__
    hf.unregister()
    assert "_prepare_static_cache" not in model_cls.__dict__


@pytest.mark.parametrize("step_kv", [False, True])
@pytest.mark.parametrize("chunks", [(5, 3, 1, 1, 1, 6), (1, 1, 1, 1, 9), (8, 8)])
def test_entries_match_transformers_dynamic_cache(registered, chunks, step_kv):
    """Calls of several lengths in a row (windows opened in one call and closed in a later one, at every
    alignment): after each, the closed windows' entries (compressor and indexer) and the layer outputs are those of
    transformers' own V4 cache and compressors (dynamic cache, same module weights, dsa_tilelang attention)."""
    from transformers import DynamicCache

    from dsa_plugins.hf import DsaV4StaticCache

    model = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang").model
    arg = _cache_kwarg(model)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 128, (2, sum(chunks)), generator=g)
    static = DsaV4StaticCache(model.config, max_cache_len=sum(chunks) + 1, step_kv=step_kv)
    dynamic = DynamicCache(config=model.config)
    done = 0
    with torch.no_grad():
        for n in chunks:
            part = ids[:, done: done + n]
            pos = torch.arange(done, done + n).expand(2, n)
            outs = [model(input_ids=part, position_ids=pos, use_cache=True, **{arg: c}).last_hidden_state
                    for c in (static, dynamic)]
            done += n
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
            for ours, theirs in zip(static.layers, dynamic.layers):
                assert int(ours.cumulative_length) == done
                for name in ours.names:
                    closed = done // ours.compress_rate
                    assert theirs.entry_count[name] == closed
                    torch.testing.assert_close(ours.entries[name][:, :closed], theirs.compressed_kv[name],
                                               rtol=1e-5, atol=1e-6)
                    assert torch.isfinite(ours.entries[name]).all()  # open and untouched rows too
                if ours.step_kv is not None:  # the step buffer: the window ring, then the entries
                    assert torch.equal(ours.step_kv[:, : ours.window], ours.keys[:, 0])
                    assert ours.entries["compressor"].data_ptr() == ours.step_kv[:, ours.window:].data_ptr()


def test_compiled_static_decode_is_one_graph(registered, make_batch, eager_and_compiled):
    """``torch.compile(fullgraph=True)`` over the prefill and the decode steps of a left-padded batch: no graph
    break (it would raise), the uncompiled model's tokens, one graph for the prefill and one for every step."""
    model = tiny.tiny_model("deepseek_v4")
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch(seed=3)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=2, cache_implementation="static")
    ref, got, frames = eager_and_compiled(model, ids, lambda: kw)
    assert torch.equal(got, ref)
    assert frames == 2, f"{frames} compiles for a prefill and 6 decode steps"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_static_cache_decode_under_cuda_graphs(registered, make_batch, static_graphs_match_dynamic, monkeypatch):
    """bf16 through the TileLang kernels at V4's attention dims (64 heads of 512 with sinks, indexer 64 x 128,
    window 128, rates 4 / 128): ``generate(cache_implementation="static")`` compiles the decode steps with CUDA
    graphs (fullgraph); the first new token and the logits of the prefill and the steps while the tokens agree are
    those of the uncompiled model with transformers' dynamic cache, on a left-padded batch."""
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    model = tiny.tiny_model(
        "deepseek_v4", num_attention_heads=64, head_dim=512, index_n_heads=64, index_head_dim=128, index_topk=64,
        sliding_window=128, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        partial_rotary_factor=0.125,
    ).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = make_batch(seq_len=300, pad=17)
    kw = dict(attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False, pad_token_id=2, output_logits=True,
              return_dict_in_generate=True)
    steps = static_graphs_match_dynamic(model, ids.cuda(), kw)
    assert len(steps) >= 4, "the greedy paths parted at once"


def test_writing_past_the_end_is_an_error(registered):
    """Past ``max_cache_len`` the rings would wrap and the mask hide the new keys: an error instead."""
    from dsa_plugins.hf import DsaV4StaticCache

    model = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang").model
    arg = _cache_kwarg(model)
    cache = DsaV4StaticCache(model.config, max_cache_len=6)
    with torch.no_grad():
        model(input_ids=torch.full((1, 5), 7), use_cache=True, **{arg: cache})
        model(input_ids=torch.full((1, 1), 7), position_ids=torch.tensor([[5]]), use_cache=True, **{arg: cache})
        with pytest.raises(RuntimeError, match=r"more tokens than its max_cache_len \(6\)"):
            model(input_ids=torch.full((1, 1), 7), position_ids=torch.tensor([[6]]), use_cache=True, **{arg: cache})


@pytest.mark.parametrize("step_kv", [True, False])
def test_step_kv_matches_eager_and_steps_read_its_buffer(registered, make_batch, greedy_matches_eager,
                                                         eager_and_compiled, monkeypatch, step_kv):
    """Eager's tokens and logits either way; with ``step_kv`` (the default) each step's attention on a compressed
    layer reads the layer's step buffer, without it none does (transformers' concatenation instead); one compiled
    graph for the prefill and one for the steps."""
    from dsa_plugins import ops
    from dsa_plugins.adapters.hf.models import deepseek_v4
    from dsa_plugins.hf import DsaV4StaticCache

    model = tiny.tiny_model("deepseek_v4")
    arg = _cache_kwarg(model)
    ids, mask = make_batch(seed=5)
    seen = []
    original = ops.sparse_attention
    monkeypatch.setattr(deepseek_v4.ops, "sparse_attention",
                        lambda q, kv, *a, **k: seen.append((q.shape[1], kv.data_ptr(), kv.shape[1]))
                        or original(q, kv, *a, **k))
    cache = DsaV4StaticCache(model.config, max_cache_len=ids.shape[1] + 6, step_kv=step_kv)
    greedy_matches_eager(model, ids, mask, **{arg: cache})
    steps = [(ptr, n) for s, ptr, n in seen if s == 1]
    buffers = {layer.step_kv.data_ptr(): layer.step_kv.shape[1] for layer in cache.layers if layer.step_kv is not None}
    assert len(buffers) == (2 if step_kv else 0) and len(steps) == 3 * 5  # 2 compressed + 1 sliding layer, 5 steps
    assert sum(ptr in buffers and n == buffers[ptr] for ptr, n in steps) == (2 * 5 if step_kv else 0)
    monkeypatch.undo()  # (the spy reads data pointers: a compiled graph would be specialised on them)
    model.set_attn_implementation("dsa_tilelang")
    ref, got, frames = eager_and_compiled(model, ids, lambda: dict(
        attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=2,
        **{arg: DsaV4StaticCache(model.config, ids.shape[1] + 5, step_kv=step_kv)}))
    assert torch.equal(got, ref) and frames == 2


def test_beam_search_matches_eager(registered, make_batch):
    """Beam search reorders the cache's batch rows (the rings and entries with them): eager's sequences."""
    model = tiny.tiny_model("deepseek_v4")
    ids, mask = make_batch(seed=2, seq_len=9, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=2, num_beams=3,
              num_return_sequences=2)
    out = {}
    for impl, extra in (("eager", {}), ("dsa_tilelang", {"cache_implementation": "static"})):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = model.generate(ids, **kw, **extra)
    assert torch.equal(out["dsa_tilelang"], out["eager"])


def test_compiled_chunked_prefill_finds_its_buffers_at_fixed_addresses(registered):
    """``prefill_chunk_size`` makes generate compile the prefill too: the cache's buffers are made before it (a
    buffer first made inside a compiled call has no fixed address, which CUDA graphs would copy or skip), every one
    marked static, and the tokens are the uncompiled model's (found by review)."""
    from transformers import CompileConfig

    model = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang")
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=2, cache_implementation="static",
              return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        torch._dynamo.reset()
        config = CompileConfig(fullgraph=True, backend="aot_eager")
        config._compile_all_devices = True  # (generate compiles on GPUs only otherwise)
        try:
            out = model.generate(ids, prefill_chunk_size=4, compile_config=config, **kw)
        finally:
            torch._dynamo.reset()
    assert torch.equal(out.sequences, ref.sequences)
    for layer in out.past_key_values.layers:
        buffers = [layer.keys, layer.cumulative_length, *layer.ring_kv.values(), *layer.ring_gate.values()]
        for entries in layer.entries.values():  # own buffers, or (step_kv) a view of the layer's step buffer
            assert entries._base is None or entries._base is layer.step_kv is not None
            buffers.append(entries if entries._base is None else entries._base)
        assert len(buffers) == 2 + 3 * len(layer.names)
        assert all(getattr(t, "_dynamo_static_input_type", None) for t in buffers), type(layer).__name__


@pytest.mark.parametrize("step_kv", [False, True])
def test_reset_cache_repeats_the_same_outputs(registered, step_kv):
    """After ``reset()`` the same cache object (same buffers) serves a new sequence as a fresh one would."""
    from dsa_plugins.hf import DsaV4StaticCache

    model = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang").model
    arg = _cache_kwarg(model)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    cache = DsaV4StaticCache(model.config, max_cache_len=12, step_kv=step_kv)

    def run():
        with torch.no_grad():
            outs = [model(input_ids=ids[:, :6], use_cache=True, **{arg: cache}).last_hidden_state]
            for t in range(6, 9):
                outs.append(model(input_ids=ids[:, t:t + 1], position_ids=torch.tensor([[t], [t]]), use_cache=True,
                                  **{arg: cache}).last_hidden_state)
        return outs

    first = run()
    cache.reset()
    assert int(cache.layers[1].cumulative_length) == 0 and not cache.layers[1].ring_kv["compressor"].any()
    for a, b in zip(first, run()):
        assert torch.equal(a, b)
