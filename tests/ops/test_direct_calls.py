"""Eager calls skip the custom-op dispatcher (its host time, per layer and step of an eager generation),
with the same results; tracing, fake tensors, modes and autograd still go through the custom ops."""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dsa_plugins import ops
from dsa_plugins.ops.backend import direct_call_ok

from ..helpers import random_indices

# the module (the package's ``sparse_attention`` attribute is the function)
sparse_attention_module = importlib.import_module("dsa_plugins.ops.sparse_attention")


def _attention_inputs(b=2, s=3, skv=11, h=4, d=16, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(b, skv, d, generator=g, dtype=torch.float64)
    return q, kv, random_indices(b, s, k, skv, generator=g)


def _indexer_inputs(b=1, s=2, tk=40, hi=4, di=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, hi, di, generator=g), torch.randn(b, tk, di, generator=g),
            torch.rand(b, s, hi, generator=g) + 0.1)


def test_direct_call_ok_only_for_plain_eager_tensors():
    t = torch.zeros(3)
    assert direct_call_ok(t, None, torch.nn.Parameter(torch.zeros(2)))
    with torch.device("cpu"):  # a torch-function mode
        assert not direct_call_ok(t)
    with FakeTensorMode():
        assert not direct_call_ok(torch.empty(3))
    assert not direct_call_ok(FakeTensorMode().from_tensor(t))


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_attention_without_autograd_calls_the_body_directly(monkeypatch):
    q, kv, idx = _attention_inputs()
    via_op = torch.ops.dsa_plugins.sparse_attention_fwd(q, kv, idx, None, 0.3, 16, "torch")
    direct = _Counting(sparse_attention_module.attention_forward)
    monkeypatch.setattr(sparse_attention_module, "attention_forward", direct)
    with torch.no_grad():
        out, lse = ops.sparse_attention(q, kv, idx, 0.3, return_lse=True)
    assert direct.calls == 1
    assert torch.equal(out, via_op[0]) and torch.equal(lse, via_op[1])
    # inputs that need a gradient go through the custom op (its autograd formula)
    leaf = q.clone().requires_grad_()
    out = ops.sparse_attention(leaf, kv, idx, 0.3)
    assert direct.calls == 1 and out.grad_fn is not None
    out.sum().backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


@pytest.mark.parametrize("b", [1, 3])
def test_indexer_topk_eager_equals_the_custom_op(b):
    iq, ik, w = _indexer_inputs(b=b, seed=b)
    tk = ik.shape[1]
    # windows past the keys and reversed ones: clamped alike (empty when start >= end)
    start = torch.tensor([-3, 5])[None].expand(b, 2)
    end = torch.tensor([tk + 7, 2])[None].expand(b, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = ops.indexer_topk(iq, ik, w, 6, start, end)
    assert not any("dsa_plugins::indexer_topk" in e.key for e in prof.key_averages())
    for e in range(b):
        rows = torch.ops.dsa_plugins.indexer_topk(iq[e], ik[e], w[e], torch.tensor([0, 5], dtype=torch.int32),
                                                  torch.tensor([tk, 5], dtype=torch.int32), 6, "torch")
        assert torch.equal(got[e].sort(-1).values, rows.sort(-1).values)
    assert bool((got[:, 1] == -1).all())  # the reversed window holds no key


@pytest.mark.parametrize("b", [1, 3])
def test_batched_windows_outside_the_keys_are_refused_in_strict_mode_whatever_the_batch(b, monkeypatch):
    iq, ik, w = _indexer_inputs(b=b, seed=b)
    start = torch.zeros(b, 2, dtype=torch.int64)
    end = torch.full((b, 2), ik.shape[1] + 1)
    monkeypatch.setenv("DSA_PLUGINS_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match="key_end"):
        ops.indexer_topk(iq, ik, w, 6, start, end)


def test_ops_still_trace_as_custom_ops():
    q, kv, idx = _attention_inputs(b=1, s=1)
    with FakeTensorMode() as mode:
        fq, fkv, fidx = (mode.from_tensor(t) for t in (q, kv, idx))
        out = ops.sparse_attention(fq, fkv, fidx, 0.3)
    assert out.shape == (1, 1, 4, 16)
    graph = torch.fx.experimental.proxy_tensor.make_fx(lambda a, c, i: ops.sparse_attention(a, c, i, 0.3))(q, kv, idx)
    assert any("dsa_plugins.sparse_attention_fwd" in str(n.target) for n in graph.graph.nodes)
