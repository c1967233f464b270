"""The same tokens however a user batches (fp32, CPU, every supported model type).

A row's logits are the same alone, in a batch, left-padded (with the positions ``generate`` passes),
and when its prompt is prefilled in chunks; greedy generation gives the same tokens batched and
alone. Two regimes: the tiny models' natural scores, and every indexer score tied (index_q zeroed
inside the fused op: all scores are 0.0 or -0.0), where only the canonical tie rule (the lowest key
wins) makes the selection independent of how rows are packed.

DeepSeek-V4's own compressors pool cache slots ``[w * rate, (w + 1) * rate)`` whatever the padding
(eager does the same), so a left-padded V4 row pools other tokens than the row alone: V4 is checked
batched without padding (equal lengths); see the README.
"""

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.adapters.hf import tiny

MODELS = list(tiny.SPECS)
PADDING_INVARIANT = [m for m in MODELS if m != "deepseek_v4"]
TOL = dict(rtol=1e-5, atol=1e-5)


def _require(model_type):
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in transformers {__import__('transformers').__version__}")


@pytest.fixture(params=["natural", "all_tied"])
def scores(request, monkeypatch):
    """``all_tied``: the fused indexer sees a zero index_q, so every key of a window ties."""
    if request.param == "all_tied":
        real = ops.indexer_topk

        def tied(index_q, *args, **kwargs):
            return real(torch.zeros_like(index_q), *args, **kwargs)

        monkeypatch.setattr(ops, "indexer_topk", tied)
    return request.param


def _out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def _model(model_type):
    torch.manual_seed(0)
    return tiny.tiny_model(model_type, attn_implementation="dsa_tilelang").eval()


def _prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (1, n), generator=g) for n in lengths]


def _left_padded(prompts):
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1]:] = p[0]
        mask[i, width - p.shape[1]:] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", MODELS)
def test_row_alone_equals_row_in_a_batch(registered, model_type, scores):
    _require(model_type)
    model = _model(model_type)
    lengths = [13, 9, 13] if model_type in PADDING_INVARIANT else [13, 13, 13]
    prompts = _prompts(lengths)
    ids, mask = _left_padded(prompts)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() passes for left padding
    with torch.no_grad():
        batched = _out(model(ids, attention_mask=mask, position_ids=position_ids))
        for i, p in enumerate(prompts):
            alone = _out(model(p))
            torch.testing.assert_close(batched[i, ids.shape[1] - p.shape[1]:], alone[0], **TOL,
                                       msg=f"row {i} ({scores})")


@pytest.mark.parametrize("model_type", MODELS)
def test_chunked_prefill_equals_one_shot(registered, model_type, scores):
    _require(model_type)
    from transformers import DynamicCache

    model = _model(model_type)
    (ids,) = _prompts([17], seed=2)
    with torch.no_grad():
        one = _out(model(ids))
        cache = DynamicCache(config=model.config)
        parts = []
        for a, b in ((0, 6), (6, 7), (7, 17)):  # chunks of 6, 1 and 10 tokens
            o = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            parts.append(_out(o))
    torch.testing.assert_close(torch.cat(parts, 1), one, **TOL)


@pytest.mark.parametrize("model_type", [m for m in MODELS if tiny.is_causal_lm(m)])
def test_greedy_generation_batched_equals_alone(registered, model_type, scores):
    _require(model_type)
    model = _model(model_type)
    lengths = [12, 7] if model_type in PADDING_INVARIANT else [12, 12]
    prompts = _prompts(lengths, seed=3)
    ids, mask = _left_padded(prompts)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=2, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kw)
        for i, p in enumerate(prompts):
            alone = model.generate(p, attention_mask=torch.ones_like(p), **kw)
            new = alone.sequences[0, p.shape[1]:]  # alone, generation may stop early at EOS
            assert torch.equal(batched.sequences[i, ids.shape[1]:ids.shape[1] + new.numel()], new), f"row {i}"
            torch.testing.assert_close(torch.stack(batched.logits)[: new.numel(), i], torch.stack(alone.logits)[:, 0],
                                       **TOL)
