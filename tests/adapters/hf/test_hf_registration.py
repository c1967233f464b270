"""Registration of "dsa_tilelang": idempotent, reversible, loud on moved patch points; the lazy mask."""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from dsa_plugins.adapters.hf.attention import dsa_attention_forward
from dsa_plugins.adapters.hf.masks import dsa_mask, mask_indices
from dsa_plugins.adapters.hf.models import MODELS, patch_model, supported_models
from dsa_plugins.patches import PatchPointMissing, UnsupportedVersion, applied_keys


def _interfaces():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


def _glm():
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as m

    return m


def test_register_twice_is_a_noop(registered):
    from dsa_plugins import hf

    _glm()
    keys = applied_keys()
    expand = _glm().GlmMoeDsaAttention.expand_kv
    hf.register()
    assert applied_keys() == keys
    assert _glm().GlmMoeDsaAttention.expand_kv is expand
    attn, masks = _interfaces()
    assert attn["dsa_tilelang"] is dsa_attention_forward
    assert masks["dsa_tilelang"] is dsa_mask
    assert hf.is_registered()


def test_unregister_restores_everything():
    from dsa_plugins import hf

    hf.unregister()
    m = _glm()
    originals = {
        (cls, name): cls.__dict__[name]
        for cls, name in ((m.GlmMoeDsaAttention, "expand_kv"), (m.GlmMoeDsaIndexer, "forward"))
    }
    hf.register()
    assert "hf.glm_moe_dsa" in applied_keys()
    assert all(cls.__dict__[name] is not fn for (cls, name), fn in originals.items())
    hf.unregister()
    assert all(cls.__dict__[name] is fn for (cls, name), fn in originals.items())
    assert not any(k.startswith("hf.") for k in applied_keys())
    attn, masks = _interfaces()
    assert "dsa_tilelang" not in attn and "dsa_tilelang" not in masks
    assert not hf.is_registered()


def test_register_before_transformers_is_imported(tmp_path):
    """register() with transformers not imported yet: the patches land when the modules finish importing."""
    code = textwrap.dedent(
        """
        import sys
        import dsa_plugins.hf as hf
        hf.register()
        assert "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa" not in sys.modules
        import torch
        from dsa_plugins.adapters.hf.tiny import tiny_model
        m = tiny_model("glm_moe_dsa", attn_implementation="dsa_tilelang")
        from dsa_plugins.patches import applied_keys
        assert "hf.glm_moe_dsa" in applied_keys(), applied_keys()
        ids = torch.randint(3, 100, (1, 9))
        assert torch.isfinite(m(ids).logits).all()
        print("OK")
        """
    )
    env = dict(os.environ, DSA_PLUGINS_AUTOLOAD="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_version_out_of_range_refuses(monkeypatch):
    from packaging.version import Version

    import dsa_plugins.patches.versions as versions
    from dsa_plugins import hf

    monkeypatch.setattr(versions, "installed_version", lambda package: Version("4.57.0"))
    with pytest.raises(UnsupportedVersion, match="transformers"):
        hf.register()


def test_moved_patch_point_fails_loudly():
    fake = types.ModuleType("transformers.models.glm_moe_dsa.modeling_fake")
    with pytest.raises(PatchPointMissing, match="GlmMoeDsaAttention"):
        MODELS["glm_moe_dsa"].patch(fake)
    fake.GlmMoeDsaAttention = type("GlmMoeDsaAttention", (), {})
    fake.GlmMoeDsaIndexer = type("GlmMoeDsaIndexer", (), {"forward": lambda self: None})
    with pytest.raises(PatchPointMissing, match="expand_kv"):
        MODELS["glm_moe_dsa"].patch(fake)


def test_unknown_and_unsupported_models():
    with pytest.raises(KeyError, match="unknown model type"):
        patch_model("llama")
    status = supported_models()
    assert "glm_moe_dsa" in status and "glm5_next" in status
    from dsa_plugins.adapters.hf.models import UNSUPPORTED

    # the block-sparse models with one selection per KV-head group are reported with their reason and refused
    assert set(UNSUPPORTED) == {"minimax_m3_vl", "qwen4_exp"}
    assert {k: status[k] for k in UNSUPPORTED} == UNSUPPORTED
    assert all(v == "not in this transformers" or v.startswith(("patched", "available"))
               for k, v in status.items() if k not in UNSUPPORTED)
    with pytest.raises(NotImplementedError, match="qwen4_exp is not supported: its QSA indexer"):
        patch_model("qwen4_exp")


@pytest.mark.parametrize("model_type", ["minimax_m3_vl", "qwen4_exp"])
def test_a_model_that_is_not_served_is_refused_under_dsa_tilelang(registered, model_type):
    """A tiny text model of each unserved sparse model type: eager runs, dsa_tilelang raises the reason (neither
    attention without the model's selection nor a crash inside its own mask code)."""
    import transformers

    config_class = {"minimax_m3_vl": "MiniMaxM3VLTextConfig", "qwen4_exp": "Qwen4ExpTextConfig"}[model_type]
    if not hasattr(transformers, config_class):
        pytest.skip(f"{model_type} is not in transformers {transformers.__version__}")
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, intermediate_size=32, pad_token_id=None)
    if model_type == "minimax_m3_vl":
        config = transformers.MiniMaxM3VLTextConfig(
            **common, moe_intermediate_size=16, num_local_experts=2, num_experts_per_tok=1, mlp_layer_types=["dense"],
            index_n_heads=2, index_head_dim=8, index_block_size=2, index_topk_blocks=2, index_local_blocks=1)
        model = transformers.MiniMaxM3VLTextModel(config)
    else:
        config = transformers.Qwen4ExpTextConfig(
            **common, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
            num_experts_per_tok=1,
            indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2,
            layer_types=["indexed_attention"])
        model = transformers.Qwen4ExpTextModel(config)
    ids = torch.randint(3, 64, (1, 10))
    with torch.no_grad():
        model(ids)
        model.set_attn_implementation("dsa_tilelang")
        with pytest.raises(NotImplementedError, match=f"{model_type} is not served by dsa_plugins: its .*indexer"):
            model(ids)


def test_bad_backend_is_a_clear_error(registered, monkeypatch, make_batch):
    from dsa_plugins.adapters.hf.tiny import tiny_model

    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "fastest")
    model = tiny_model("glm_moe_dsa", attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with pytest.raises(ValueError, match="DSA_PLUGINS_BACKEND"):
        model(ids, attention_mask=mask)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal of the forced kernel backend")
def test_forced_kernels_on_cpu_is_a_clear_error(registered, monkeypatch, make_batch):
    from dsa_plugins.adapters.hf.tiny import tiny_model

    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    model = tiny_model("glm_moe_dsa", attn_implementation="dsa_tilelang")
    ids, mask = make_batch()
    with pytest.raises(RuntimeError):
        model(ids, attention_mask=mask)


def test_kv_b_proj_bias_is_refused(registered, make_batch):
    from dsa_plugins.adapters.hf.tiny import tiny_model

    model = tiny_model("deepseek_v32", attn_implementation="dsa_tilelang")
    attn = model.model.layers[0].self_attn
    attn.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(attn.kv_b_proj.out_features))
    ids, mask = make_batch()
    with pytest.raises(RuntimeError, match="kv_b_proj has a bias"):
        model(ids, attention_mask=mask)


def test_v4_refuses_prebuilt_4d_mask(registered):
    from dsa_plugins.adapters.hf.tiny import tiny_model

    model = tiny_model("deepseek_v4", attn_implementation="dsa_tilelang")
    ids = torch.randint(3, 100, (1, 8))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    with pytest.raises(RuntimeError, match="prebuilt 4D mask"):
        model(ids, attention_mask=mask)


def test_additive_mask_with_a_bias_is_refused_and_zero_min_masks_run(registered):
    """A 4D additive mask: 0 / the dtype's minimum runs (as the boolean mask does); a finite bias elsewhere, which
    the sparse path cannot add, is an error saying so instead of being dropped."""
    from dsa_plugins.adapters.hf.tiny import tiny_model

    model = tiny_model("deepseek_v32", attn_implementation="dsa_tilelang")
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 8, 8).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, attention_mask=additive).logits, model(ids, attention_mask=causal).logits)
        additive[..., 0] = torch.where(causal[..., 0], -2.0, additive[..., 0])
        with pytest.raises(ValueError, match="values other than 0 and the dtype's minimum"):
            model(ids, attention_mask=additive)


# ---------------------------------------------------------------------------------------- LazyMask

CASES = [
    dict(B=2, S=7, T=7, q_offset=0, kv_offset=0, pad=[0, 3], window=None),
    dict(B=2, S=1, T=12, q_offset=11, kv_offset=0, pad=[0, 4], window=None),  # decode
    dict(B=2, S=5, T=9, q_offset=4, kv_offset=0, pad=[2, 0], window=None),  # chunked prefill
    dict(B=2, S=7, T=7, q_offset=0, kv_offset=0, pad=[0, 2], window=3),  # sliding prefill
    dict(B=2, S=1, T=4, q_offset=10, kv_offset=7, pad=[0, 9], window=5),  # sliding decode, window full
    dict(B=1, S=4, T=6, q_offset=2, kv_offset=0, pad=None, window=None),
    dict(B=1, S=1, T=16, q_offset=torch.tensor(9), kv_offset=0, pad=None, window=None),  # static cache's counter
    dict(B=1, S=3, T=8, q_offset=torch.tensor(6), kv_offset=0, pad=None, window=4),  # rows past the keys
    dict(B=1, S=2, T=5, q_offset=1, kv_offset=3, pad=None, window=2),  # rows before the first key
]


@pytest.mark.parametrize("case", CASES)
def test_lazy_mask_matches_dense(case):
    from transformers.masking_utils import (
        causal_mask_function,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    B, S, T = case["B"], case["S"], case["T"]
    total = case["kv_offset"] + T
    padding = None
    if case["pad"] is not None:
        padding = torch.ones(B, total, dtype=torch.bool)
        for b, p in enumerate(case["pad"]):
            padding[b, :p] = False
    fn = causal_mask_function if case["window"] is None else sliding_window_causal_mask_function(case["window"])
    kwargs = dict(q_offset=case["q_offset"], kv_offset=case["kv_offset"], mask_function=fn, attention_mask=padding)
    lazy = dsa_mask(B, S, T, local_size=case["window"], **kwargs)
    assert lazy.is_simple
    dense = sdpa_mask(batch_size=B, q_length=S, kv_length=T, allow_is_causal_skip=False, **kwargs)
    dense = dense.expand(B, 1, S, T)[:, 0]
    cols = torch.arange(T).expand(B, S, T)
    assert torch.equal(lazy.allowed(cols), dense)
    start, end = lazy.windows()
    assert start.shape == end.shape == (B, S)
    assert bool(((0 <= start) & (start <= end) & (end <= T)).all())  # what select_topk relies on
    in_window = (cols >= start[..., None]) & (cols < end[..., None])
    assert torch.equal(in_window & dense, dense)  # the window covers every allowed key
    # ... and no more than them (left padding leaves no holes): empty where nothing is allowed
    first = torch.where(dense.any(-1), dense.int().argmax(-1), 0)
    last = torch.where(dense.any(-1), T - dense.flip(-1).int().argmax(-1), 0)
    nonempty = end > start
    assert torch.equal(nonempty, dense.any(-1))
    assert torch.equal(start[nonempty], first[nonempty]) and torch.equal(end[nonempty], last[nonempty])
    assert torch.equal(lazy[:, 0], lazy) if False else lazy[:, 0] is lazy
    assert torch.equal(lazy.dense()[:, 0], dense)
    idx = torch.randint(-2, T + 2, (B, S, 5))
    want = torch.where((idx >= 0) & (idx < T) & dense.gather(-1, idx.clamp(0, T - 1)), idx, -1)
    assert torch.equal(mask_indices(idx, lazy).long(), want)
    assert torch.equal(mask_indices(idx.int(), lazy).long(), want)  # int32 in, same answer
    huge = idx.clone()
    huge[..., 0] = 2**40 + 1  # an int64 column that would wrap onto a valid int32 one
    assert bool((mask_indices(huge, lazy)[..., 0] == -1).all())


def test_a_static_cache_s_short_padding_is_padded_to_the_cache_length():
    """A static cache's 2D mask covers the tokens so far (it grows a column a step) while the mask spans the cache:
    the mask pads it to the cache's length when it is made (one shape for every compiled step); the columns past
    it are masked and the windows are those of the full-length mask."""
    short = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.long)
    lazy = dsa_mask(2, 1, 12, q_offset=torch.tensor(4), kv_offset=0, attention_mask=short)
    assert lazy.padding.shape == (2, 12) and not bool(lazy.padding[:, 5:].any())
    full = dsa_mask(2, 1, 12, q_offset=torch.tensor(4), kv_offset=0,
                    attention_mask=torch.nn.functional.pad(short, (0, 7)))
    for a, b in zip(lazy.windows(), full.windows(), strict=True):
        assert torch.equal(a, b)
    assert lazy.windows()[0].tolist() == [[2], [0]] and lazy.windows()[1].tolist() == [[5], [5]]
    assert not lazy.has_holes()


def test_a_custom_mask_over_a_long_padding_mask_is_boolean():
    """A custom mask function over a long (0/1) 2D mask: the dense mask is bool, so windows and index masking run
    (transformers' and_masks gives bool & long = long, and torch.where refuses a long condition)."""
    from transformers.masking_utils import and_masks, causal_mask_function

    fn = and_masks(causal_mask_function, lambda b, h, q, k: k != 2)
    lazy = dsa_mask(1, 2, 4, q_offset=2, mask_function=fn, attention_mask=torch.tensor([[0, 1, 1, 1]]),
                    use_vmap=True)
    assert not lazy.is_simple and lazy.dense().dtype == torch.bool
    assert [w.tolist() for w in lazy.windows()] == [[[1, 1]], [[2, 4]]]
    idx = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    assert mask_indices(idx, lazy).tolist() == [[[-1, 1, -1, -1], [-1, 1, -1, 3]]]


def test_first_and_last_true_columns():
    from dsa_plugins.adapters.hf.masks import first_true, last_true

    rows = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1]], dtype=torch.bool)
    for dtype in (torch.bool, torch.long):  # a custom mask function over a long 2D mask makes a long dense mask
        assert first_true(rows.to(dtype)).tolist() == [1, 4, 0, 0]
        assert last_true(rows.to(dtype)).tolist() == [2, -1, 3, 3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_windows_of_left_padded_masks_are_eager_s():
    """The windows of left-padded masks under torch.compile (inductor, GPU) are the eager ones: inductor's argmax
    over the padding as int8 came back wrapped to int8 (H100, torch 2.11: 682 -> -86), and a compiled generation
    step took windows that began inside the sequences' tokens."""
    lead = [0, 682, 1365, 2048, 4095]
    pad = torch.ones(len(lead), 4097, dtype=torch.long, device="cuda")
    for b, n in enumerate(lead):
        pad[b, :n] = 0

    def windows(pad, offset):
        return dsa_mask(len(lead), 1, 8192, q_offset=offset, kv_offset=0, attention_mask=pad).windows()

    offset = torch.tensor(4096, device="cuda")
    torch._dynamo.reset()
    try:
        got = torch.compile(windows, fullgraph=True)(pad, offset)
    finally:
        torch._dynamo.reset()
    want = windows(pad, offset)
    assert want[0][:, 0].tolist() == lead and want[1][:, 0].tolist() == [4097] * len(lead)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_tiny_configs_spell_indexed_layers_as_the_installed_transformers_does(monkeypatch):
    """transformers 5.17's glm5_next names its DSA layers "deepseek_sparse_attention" and refuses
    "indexed_attention" (5.24's name): the tiny configs follow whichever the installed release allows."""
    from transformers import configuration_utils

    from dsa_plugins.adapters.hf.tiny import _installed_layer_types

    types_ = ["indexed_attention", "linear_attention", "sliding_attention"]
    old = tuple(t for t in configuration_utils.ALLOWED_ATTN_LAYER_TYPES if t != "indexed_attention")
    monkeypatch.setattr(configuration_utils, "ALLOWED_ATTN_LAYER_TYPES", old + ("deepseek_sparse_attention",))
    assert _installed_layer_types(types_) == ["deepseek_sparse_attention", "linear_attention", "sliding_attention"]
    monkeypatch.setattr(configuration_utils, "ALLOWED_ATTN_LAYER_TYPES", old + ("indexed_attention",))
    assert _installed_layer_types(types_) == types_
