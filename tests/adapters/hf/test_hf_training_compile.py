"""A whole forward and backward under ``torch.compile(fullgraph=True)`` (fp32, CPU): what ``torch.compile(model)``
in a training loop traces. Every supported model type must trace as one graph with ``dsa_tilelang`` whenever it
does with eager attention, and give eager's loss and gradients.

Before these tests DeepSeek-V4 and glm5_next failed there: the sliding layers' mask was recognised by reading
the closure cells of transformers' ``and_masks`` (which dynamo cannot read), DeepSeek-V4's indexer stopped the
model's own forward with an exception whose ``__init__`` called ``super()``, and glm5_next branched on a pool count
that depends on the data. The ``aot_eager`` backend traces the forward and the backward as inductor does, without
generating code. Without the mask patch a compiled sliding layer would still be right (on a dense mask): the last
test is what holds the patch, which keeps it on the O(S) windows.
"""

import functools

import pytest
import torch

from dsa_plugins.adapters.hf import tiny


def _loss_and_grads(model, forward, ids, mask):
    model.zero_grad(set_to_none=True)
    out = forward(input_ids=ids, attention_mask=mask)[0]
    loss = out.float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _skip_if_eager_cannot_trace_either(model_type, ids, mask, ours_error):
    """The contract is "traces whenever eager attention does": when ours failed, the same step with eager attention
    decides. Some transformers releases cannot trace these models' training step at all (5.17's MoE fallback
    branches on a data-dependent expert count in its backward): then the test skips, naming the error."""
    torch._dynamo.reset()
    eager = tiny.tiny_model(model_type, attn_implementation="eager", seed=1)
    eager.config.use_cache = False
    try:
        _loss_and_grads(eager, torch.compile(eager, fullgraph=True, backend="aot_eager"), ids, mask)
    except Exception as eager_error:
        first = (str(eager_error).strip().splitlines() or [type(eager_error).__name__])[0][:200]
        pytest.skip(f"transformers {__import__('transformers').__version__} cannot trace a {model_type} training step "
                    f"with eager attention either: {first}")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("model_type", list(tiny.SPECS))
def test_fullgraph_training_step_matches_eager(registered, model_type, make_batch):
    """A batch whose second sequence is left-padded (the mask's padding path; the first is a plain causal row)."""
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in transformers {__import__('transformers').__version__}")
    ids, mask = make_batch(seed=4, seq_len=21, pad=5)
    model = tiny.tiny_model(model_type, attn_implementation="dsa_tilelang", seed=1)
    model.config.use_cache = False  # training
    loss, grads = _loss_and_grads(model, model, ids, mask)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        c_loss, c_grads = _loss_and_grads(model, compiled, ids, mask)
    except Exception as ours_error:
        _skip_if_eager_cannot_trace_either(model_type, ids, mask, ours_error)
        raise
    torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
    assert grads, "the eager step gave no gradient"
    for name, g in grads.items():
        torch.testing.assert_close(c_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # parameters with no gradient in eager (indexers behind a top-k) may get zeros from a compiled graph
    # (DeepSeek-V4's do with eager attention too); never a value
    for name in c_grads.keys() - grads.keys():
        assert not c_grads[name].any(), name


def test_glm5_next_compiled_with_fewer_tokens_than_a_pool(registered):
    """No complete key pool at all (fewer tokens than ``index_kpool``): the compiled selection, which cannot ask
    how many pools there are, takes every slot of the op and must give eager's output."""
    if not tiny.available("glm5_next"):
        pytest.skip("glm5_next is not in this transformers")
    model = tiny.tiny_model("glm5_next", attn_implementation="dsa_tilelang", seed=1).eval()
    assert model.config.index_kpool > 1
    ids = torch.tensor([[5, 7]])[:, : model.config.index_kpool - 1]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False)[0]
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, use_cache=False)[0]
    torch.testing.assert_close(out, ref)


def test_the_sliding_mask_function_is_transformers_own_mask_under_a_code_of_its_own(registered):
    """The patched ``sliding_window_causal_mask_function`` gives transformers' mask, has the code the lazy mask
    recognises (also while compiling; a wrapper that copies its name is not it), and is reverted by ``unregister``."""
    from transformers import masking_utils as mu

    from dsa_plugins.adapters.hf.masks import PLAIN_SLIDING_CODE, _is_plain_sliding

    window = 3
    ours = mu.sliding_window_causal_mask_function(window)
    theirs = mu.and_masks(mu.sliding_window_overlay(window), mu.causal_mask_function)
    assert ours.__code__ is PLAIN_SLIDING_CODE
    q, kv = torch.arange(9)[:, None], torch.arange(12)[None, :]
    b = h = torch.zeros((), dtype=torch.long)
    assert torch.equal(ours(b, h, q, kv), theirs(b, h, q, kv))
    assert _is_plain_sliding(ours, mu.causal_mask_function)
    assert _is_plain_sliding(theirs, mu.causal_mask_function)  # eager: read from the closure
    assert not _is_plain_sliding(mu.and_masks(ours, lambda *a: True), mu.causal_mask_function)

    @functools.wraps(ours)
    def narrower(batch_idx, head_idx, q_idx, kv_idx):
        return ours(batch_idx, head_idx, q_idx, kv_idx) & (kv_idx != 1)

    assert not _is_plain_sliding(narrower, mu.causal_mask_function)
    compiled_answers = []

    @torch.compile(fullgraph=True, backend="eager")
    def recognise(x):
        compiled_answers.append((_is_plain_sliding(ours, mu.causal_mask_function),
                                 _is_plain_sliding(theirs, mu.causal_mask_function)))
        return x + 1

    recognise(torch.zeros(1))
    # while compiling, transformers' own closure cannot be read: it takes the dense mask (correct for any mask)
    assert compiled_answers == [(True, False)]
    registered.unregister()
    assert mu.sliding_window_causal_mask_function(window).__code__ is not PLAIN_SLIDING_CODE
    registered.register()


#: the models whose compiled training step runs on the GPU kernels (at tiny.kernel_sizes)
_GPU_MODELS = ("deepseek_v4", "glm_moe_dsa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model_type", _GPU_MODELS)
def test_gpu_compiled_training_step_runs_the_kernels(registered, model_type, make_batch, monkeypatch):
    """bf16 on the GPU with the kernels forced: inductor compiles the whole training step (fullgraph) around our
    custom ops, and its loss and gradients are those of the same model run uncompiled (same precision: the
    difference is inductor's fusions and the backward's atomics)."""
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in this transformers")
    import importlib

    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    # the attention kernels run in both steps (the custom ops' bodies look them up at run time)
    engine = importlib.import_module("dsa_plugins.ops.attention_custom_ops")
    launched, real_load = [], engine.load_kernel
    monkeypatch.setattr(engine, "load_kernel", lambda name: launched.append(name) or real_load(name))
    ids, mask = make_batch(seed=4, seq_len=256, pad=17)
    ids, mask = ids.cuda(), mask.cuda()
    model = tiny.tiny_model(model_type, attn_implementation="dsa_tilelang", seed=1, **tiny.kernel_sizes(model_type))
    model = model.to("cuda", torch.bfloat16)
    model.config.use_cache = False
    loss, grads = _loss_and_grads(model, model, ids, mask)
    assert {"sparse_attention_fwd", "sparse_attention_bwd"} <= set(launched), launched
    launched.clear()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True)
        c_loss, c_grads = _loss_and_grads(model, compiled, ids, mask)
    finally:
        torch._dynamo.reset()
    assert {"sparse_attention_fwd", "sparse_attention_bwd"} <= set(launched), launched
    assert torch.isfinite(c_loss)
    assert abs(c_loss.item() - loss.item()) <= 2e-2 * abs(loss.item()), (c_loss, loss)
    assert grads and any(".indexer." not in n and g.abs().sum() > 0 for n, g in grads.items())
    for name, g in grads.items():
        c = c_grads[name].float()
        assert torch.isfinite(c).all(), name
        err = (c - g.float()).norm().item()
        assert err <= 5e-2 * g.float().norm().item() + 1e-5, (name, err, g.float().norm().item())
