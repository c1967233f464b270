"""The chunked reference against an independent dense float64 formulation."""

import pytest
import torch

import dsa_plugins.reference.sparse_attention as ref_mod
from dsa_plugins.reference import sparse_attention_dense, sparse_attention_reference

from ..helpers import random_indices, rel_err

CASES = [
    # b, s, skv, h, d, dv, k, sink
    (1, 1, 1, 1, 8, 8, 1, False),
    (1, 3, 5, 2, 16, 16, 4, True),
    (2, 7, 11, 4, 24, 16, 9, False),
    (2, 5, 3, 3, 8, 8, 12, True),  # k > skv
    (1, 17, 64, 16, 32, 32, 33, True),
    (3, 4, 9, 1, 12, 5, 2, False),
]


def _inputs(b, s, skv, h, d, k, sink, seed, dtype=torch.float64, sink_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    kv = torch.randn(b, skv, d, generator=g, dtype=dtype)
    idx = random_indices(b, s, k, skv, generator=g)
    z = torch.randn(h, generator=g, dtype=dtype) * sink_scale if sink else None
    return q, kv, idx, z


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_matches_dense(case, seed, monkeypatch):
    b, s, skv, h, d, dv, k, sink = case
    monkeypatch.setattr(ref_mod, "_CHUNK_BYTES", 4096)  # many chunks
    q, kv, idx, z = _inputs(b, s, skv, h, d, k, sink, seed)
    out, lse = sparse_attention_reference(q, kv, idx, 0.37, z, dv)
    out_d, lse_d = sparse_attention_dense(q, kv, idx, 0.37, z, dv)
    assert out.shape == (b, s, h, dv) and lse.shape == (b, s, h)
    torch.testing.assert_close(out, out_d, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_d, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_backward_matches_dense_autograd(case, monkeypatch):
    b, s, skv, h, d, dv, k, sink = case
    monkeypatch.setattr(ref_mod, "_CHUNK_BYTES", 4096)
    q, kv, idx, z = _inputs(b, s, skv, h, d, k, sink, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, kv) + ((z,) if sink else ())]
    leaves_d = [t.clone().requires_grad_() for t in (q, kv) + ((z,) if sink else ())]
    dout = torch.randn(b, s, h, dv, dtype=torch.float64)
    out, _ = sparse_attention_reference(leaves[0], leaves[1], idx, 0.5, leaves[2] if sink else None, dv)
    (out * dout).sum().backward()
    out_d, _ = sparse_attention_dense(leaves_d[0], leaves_d[1], idx, 0.5, leaves_d[2] if sink else None, dv)
    (out_d * dout).sum().backward()
    for a, bb in zip(leaves, leaves_d):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad, bb.grad, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("sink", [False, True])
def test_gradcheck(sink):
    q, kv, idx, z = _inputs(2, 3, 5, 2, 6, 4, sink, seed=5)
    args = (q.requires_grad_(), kv.requires_grad_()) + ((z.requires_grad_(),) if sink else ())

    def fn(q_, kv_, *z_):
        return sparse_attention_reference(q_, kv_, idx, 0.8, z_[0] if z_ else None, 4)[0]

    assert torch.autograd.gradcheck(fn, args)


@pytest.mark.parametrize("sink_value", [None, 0.0, 60.0, -60.0, -1e30])
def test_empty_rows_give_zero_out_inf_lse_zero_grads(sink_value):
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([[[-1, -1], [7, -3], [0, 2], [6, 100]]], dtype=torch.int32)  # rows 0, 1, 3 empty
    z = None if sink_value is None else torch.full((3,), sink_value, dtype=torch.float64, requires_grad=True)
    out, lse = sparse_attention_reference(q, kv, idx, 1.0, z, None)
    empty = torch.tensor([True, True, False, True])
    assert torch.all(out[0, empty] == 0)
    assert torch.all(torch.isposinf(lse[0, empty]))
    assert torch.isfinite(lse[0, 2]).all()
    out.sum().backward()
    assert torch.all(q.grad[0, empty] == 0)
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert torch.all(kv.grad[0, [1, 3, 4, 5]] == 0)  # never selected by a valid slot
    if z is not None:
        assert torch.isfinite(z.grad).all()


def test_large_sinks_are_stable():
    q, kv, idx, _ = _inputs(1, 5, 7, 2, 8, 3, False, seed=9)
    for value in (80.0, -80.0):
        z = torch.full((2,), value, dtype=torch.float64)
        out, lse = sparse_attention_reference(q, kv, idx, 1.0, z, None)
        out_d, _ = sparse_attention_dense(q, kv, idx, 1.0, z, None)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, out_d)
        if value > 0:
            assert out.abs().max() < 1e-20  # the sink takes all the mass


def test_duplicates_count_as_many_times_as_they_appear():
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    kv = torch.randn(1, 3, 4, dtype=torch.float64)
    twice = sparse_attention_reference(q, kv, torch.tensor([[[0, 0, 1]]], dtype=torch.int32), 1.0)[0]
    s = (q[0, 0, 0] @ kv[0].T)
    w = torch.stack([2 * s[0].exp(), s[1].exp()])
    expected = (w[0] * kv[0, 0] + w[1] * kv[0, 1]) / w.sum()
    torch.testing.assert_close(twice[0, 0, 0], expected)


def test_low_precision_inputs_compute_in_fp32():
    q, kv, idx, z = _inputs(1, 9, 13, 4, 32, 7, True, seed=2, dtype=torch.float32)
    out, lse = sparse_attention_reference(q.bfloat16(), kv.bfloat16(), idx, 0.2, z, None)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    out_d, _ = sparse_attention_dense(q.bfloat16().double(), kv.bfloat16().double(), idx, 0.2, z.double(), None)
    assert rel_err(out.float(), out_d) < 1e-2
