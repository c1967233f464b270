import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture
def registered():
    """dsa_plugins' transformers adapter registered for the test, reverted after it."""
    from dsa_plugins import hf

    hf.register()
    yield hf
    hf.unregister()


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    logger = logging.getLogger("dsa_plugins")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def batch(seed: int = 0, batch_size: int = 2, seq_len: int = 14, pad: int = 3, vocab: int = 128):
    """Random ids with left padding on the last row (``pad`` tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, :pad] = 0
    return ids, mask


def output_tensor(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_greedy_generate_matches_eager(model, ids, mask, config_of=lambda m: m.config, **generate_kwargs):
    """Greedy generation (6 tokens, KV cache) under eager and dsa_tilelang: same tokens, same logits.
    ``generate_kwargs`` go to the dsa_tilelang run (eager runs with transformers' default cache)."""
    seqs, logits = {}, {}
    for impl in ("eager", "dsa_tilelang"):
        model.set_attn_implementation(impl)
        assert config_of(model)._attn_implementation == impl
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2,
                output_logits=True, return_dict_in_generate=True, **(generate_kwargs if impl != "eager" else {}),
            )
        seqs[impl], logits[impl] = out.sequences, torch.stack(out.logits)
    assert torch.equal(seqs["dsa_tilelang"], seqs["eager"])
    torch.testing.assert_close(logits["dsa_tilelang"], logits["eager"], rtol=1e-5, atol=2e-5)


def generate_eager_and_compiled(model, ids, kwargs):
    """``model.generate(ids, **kwargs())`` uncompiled, then with ``model.forward`` under ``torch.compile(fullgraph=
    True)`` (aot_eager: traces as inductor does, no code generation). ``kwargs``: a callable, so that each run can
    take a fresh cache. Returns (uncompiled output, compiled output, frames compiled)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    with torch.no_grad():
        ref = model.generate(ids, **kwargs())
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
        try:
            got = model.generate(ids, **kwargs())
        finally:
            del model.forward
            torch._dynamo.reset()
    return ref, got, counter.frame_count


@pytest.fixture
def eager_and_compiled():
    return generate_eager_and_compiled


@pytest.fixture
def greedy_matches_eager():
    return assert_greedy_generate_matches_eager


@pytest.fixture
def make_batch():
    return batch


@pytest.fixture
def output_of():
    return output_tensor


def gpu_generation_case(model_type: str, seq_len: int = 200, pad: int = 17):
    """(model, ids, generate kwargs) for the GPU generation tests: the tiny ``model_type`` with GLM-5's attention
    and indexer dims (64 heads, latent 512 + 64, 32 index heads of 128, top-k 64) in bf16 on the GPU under
    dsa_tilelang, a batch of ``seq_len`` tokens whose last sequence has ``pad`` of them as left padding, greedy
    kwargs that return the logits."""
    from dsa_plugins.adapters.hf import tiny

    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in this transformers")
    model = tiny.tiny_model(model_type, **tiny.kernel_sizes(model_type)).to("cuda", torch.bfloat16).eval()
    model.set_attn_implementation("dsa_tilelang")
    ids, mask = batch(seq_len=seq_len, pad=pad)
    kw = dict(attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False, pad_token_id=2, output_logits=True,
              return_dict_in_generate=True)
    return model, ids.cuda(), kw


@pytest.fixture
def gpu_generation():
    return gpu_generation_case


def assert_static_graphs_match_dynamic(model, ids, kw) -> list:
    """``generate(cache_implementation="static")`` compiled with CUDA graphs (fullgraph, so a graph break fails),
    twice, against the uncompiled model with a dynamic cache: the two compiled runs give the same tokens, the first
    new token is the dynamic run's, and the logits of the prefill, the first decode step (compiled code; cudagraph
    trees run a first call unrecorded) and every later step (recorded, then replayed) while the tokens so far agree
    (greedy paths may part at a near-tie) are finite and within 5% of the largest logit. Returns the steps compared."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    with torch.no_grad():
        dynamic = model.generate(ids, **kw)
        static = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(fullgraph=True), **kw)
        again = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(fullgraph=True), **kw)
    torch._dynamo.reset()
    assert torch.equal(static.sequences, again.sequences)  # graph replays are deterministic
    first = ids.shape[1]
    assert torch.equal(static.sequences[:, first], dynamic.sequences[:, first])
    steps = [0, 1] + [s for s in range(2, len(static.logits))
                      if torch.equal(static.sequences[:, : first + s], dynamic.sequences[:, : first + s])]
    for step in steps:
        a, b = dynamic.logits[step].float(), static.logits[step].float()
        assert torch.isfinite(b).all()
        assert (a - b).abs().max().item() < 0.05 * a.abs().max().item() + 0.05, step
    return steps


@pytest.fixture
def static_graphs_match_dynamic():
    return assert_static_graphs_match_dynamic
