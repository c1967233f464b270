"""Indexer KL loss against a direct dense formulation (and megatron's formula without its epsilon)."""

import pytest
import torch

from dsa_plugins.reference import causal_key_windows, indexer_kl_loss_reference
import dsa_plugins.reference.indexer_loss as loss_mod


def _inputs(t=9, h=3, d=6, hi=2, di=5, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(t, d, generator=g, dtype=torch.float64)
    iq = torch.randn(t, hi, di, generator=g, dtype=torch.float64, requires_grad=True)
    ik = torch.randn(t, di, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(t, hi, generator=g, dtype=torch.float64, requires_grad=True)
    # causal top-k sets with -1 padding (row t has t+1 keys)
    idx = torch.full((t, k), -1, dtype=torch.int32)
    for row in range(t):
        cand = torch.randperm(row + 1, generator=g)[:k]
        idx[row, : len(cand)] = cand.to(torch.int32)
    return q, kv, iq, ik, w, idx


def _direct(q, kv, iq, ik, w, scale, mask, sink=None):
    """Dense formulation over a boolean [T, Tk] slot mask (sparse set or causal window)."""
    s = torch.einsum("thd,sd->hts", q, kv) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    if sink is not None:
        lse = torch.logaddexp(lse, sink[:, None])
    p = torch.exp(s - lse[..., None]).sum(0)
    p = p / p.sum(-1, keepdim=True)
    scores = torch.einsum("thd,sd->ths", iq, ik).clamp_min(0)
    scores = torch.einsum("ths,th->ts", scores, w).masked_fill(~mask, float("-inf"))
    logq = torch.log_softmax(scores, -1)
    return torch.where(p > 0, p * (torch.log(p) - logq), torch.zeros_like(p)).sum(-1).mean()


def _sparse_mask(idx, tk):
    mask = torch.zeros(idx.shape[0], tk, dtype=torch.bool)
    valid = idx >= 0
    mask[torch.arange(idx.shape[0]).unsqueeze(1).expand_as(idx)[valid], idx[valid].long()] = True
    return mask


@pytest.mark.parametrize("with_sink", [False, True])
def test_sparse_loss_and_grads_match_direct(with_sink, monkeypatch):
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMS", 16)
    q, kv, iq, ik, w, idx = _inputs()
    sink = torch.randn(q.shape[1], dtype=torch.float64) if with_sink else None
    loss = indexer_kl_loss_reference(iq, ik, w, q, kv, None, 0.4, topk_indices=idx, sink=sink)
    grads = torch.autograd.grad(loss, (iq, ik, w))
    direct = _direct(q, kv, iq, ik, w, 0.4, _sparse_mask(idx, kv.shape[0]), sink)
    grads_d = torch.autograd.grad(direct, (iq, ik, w))
    torch.testing.assert_close(loss, direct)
    for a, b in zip(grads, grads_d):
        torch.testing.assert_close(a, b)


def test_dense_loss_matches_direct_and_megatron_formula():
    q, kv, iq, ik, w, _ = _inputs(seed=1)
    t = q.shape[0]
    start, end = causal_key_windows(torch.tensor([0, t]))
    loss = indexer_kl_loss_reference(iq, ik, w, q, kv, None, 0.3, key_start=start, key_end=end)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    torch.testing.assert_close(loss, _direct(q, kv, iq, ik, w, 0.3, causal))
    # megatron's compute_dsa_indexer_loss (dense) with its 1e-10 epsilon: same value up to the epsilon's effect
    s = (torch.einsum("thd,sd->hts", q, kv) * 0.3).masked_fill(~causal, float("-inf")).softmax(-1).sum(0)
    s = s / s.sum(-1, keepdim=True)
    scores = torch.einsum("ths,th->ts", torch.einsum("thd,sd->ths", iq, ik).clamp_min(0), w)
    qi = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    megatron = (s * (torch.log(s + 1e-10) - torch.log(qi + 1e-10))).sum(-1).mean()
    torch.testing.assert_close(loss, megatron, rtol=0, atol=1e-6)


def test_given_lse_is_used():
    q, kv, iq, ik, w, idx = _inputs(seed=2)
    lse = torch.randn(q.shape[0], q.shape[1], dtype=torch.float64) + 3
    a = indexer_kl_loss_reference(iq, ik, w, q, kv, lse, 0.4, topk_indices=idx)
    b = indexer_kl_loss_reference(iq, ik, w, q, kv, None, 0.4, topk_indices=idx)
    # p is L1-normalised after summing heads, so only a head-dependent lse changes it
    assert not torch.allclose(a, b)


def test_gradcheck_sparse():
    q, kv, iq, ik, w, idx = _inputs(t=5, k=3, seed=4)
    assert torch.autograd.gradcheck(
        lambda a, b, c: indexer_kl_loss_reference(a, b, c, q, kv, None, 0.5, topk_indices=idx), (iq, ik, w)
    )


def test_no_gradient_reaches_attention_inputs():
    q, kv, iq, ik, w, idx = _inputs(seed=6)
    q.requires_grad_()
    kv.requires_grad_()
    loss = indexer_kl_loss_reference(iq, ik, w, q, kv, None, 0.4, topk_indices=idx)
    loss.backward()
    assert q.grad is None and kv.grad is None
    assert iq.grad is not None and torch.isfinite(iq.grad).all()


def test_empty_rows_contribute_zero():
    q, kv, iq, ik, w, idx = _inputs(seed=7)
    idx[0] = -1
    loss = indexer_kl_loss_reference(iq, ik, w, q, kv, None, 0.4, topk_indices=idx)
    loss.backward()
    assert torch.isfinite(loss) and torch.all(iq.grad[0] == 0) and torch.isfinite(ik.grad).all()
