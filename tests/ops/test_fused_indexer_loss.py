"""The sparse-stage indexer loss fused into the sparse attention's backward (FusedIndexerLoss).

Oracle: the unfused path, sparse attention plus indexer_kl_loss (reference) over the same slots
with the attention's own lse, whose gradients must equal the fused op's in float64 on CPU; on the
GPU the kernels (bf16) against that oracle in float64.
"""

import os

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.reference.indexer_loss import indexer_kl_loss_reference

from ..helpers import random_indices, rel_err


def _inputs(b, s, skv, h, dqk, k, hi, di, sink, dtype=torch.float64, device="cpu", seed=None):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") if seed is None else seed)
    q = torch.randn(b, s, h, dqk, generator=g)
    kv = torch.randn(b, skv, dqk, generator=g)
    idx = random_indices(b, s, k, skv, generator=g)
    iq = torch.randn(b * s, hi, di, generator=g)
    ik = torch.randn(b * skv, di, generator=g)
    w = torch.randn(b * s, hi, generator=g) * di ** -0.5
    z = torch.randn(h, generator=g) * 2 if sink else None
    cast = [t.to(device, dtype) for t in (q, kv, iq, ik)]
    return (*cast[:2], idx.to(device), *cast[2:], w.to(device, torch.float32 if dtype != torch.float64 else dtype),
            None if z is None else z.to(device, torch.float32 if dtype != torch.float64 else dtype))


def _unfused(q, kv, idx, iq, ik, w, z, scale, dv, weight, backend="torch"):
    """(out, loss value, grads of q, kv, iq, ik, w) of attention + weight * reference indexer loss."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, iq, ik, w)]
    out, lse = ops.sparse_attention(leaves[0], leaves[1], idx, scale, sink=z, dv=dv, backend=backend, return_lse=True)
    b, s, skv = q.shape[0], q.shape[1], kv.shape[1]
    valid = (idx >= 0) & (idx < skv)
    rows = torch.where(valid, idx + (torch.arange(b, device=idx.device) * skv).view(b, 1, 1), -1).reshape(b * s, -1)
    loss = indexer_kl_loss_reference(
        leaves[2], leaves[3], leaves[4], leaves[0].reshape(b * s, *q.shape[2:]), leaves[1].reshape(b * skv, -1),
        lse.reshape(b * s, -1), scale, topk_indices=rows, sink=z,
    )
    dout = torch.ones_like(out)
    grads = torch.autograd.grad((out * dout).sum() + weight * loss, leaves)
    return out.detach(), loss.detach(), grads


def _fused(q, kv, idx, iq, ik, w, z, scale, dv, weight, backend, packed=False):
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, iq, ik, w)]
    seen = []
    handle = ops.FusedIndexerLoss(leaves[2], leaves[3], leaves[4], weight=weight, on_value=seen.append)
    if packed:
        out = ops.sparse_attention(leaves[0][0], leaves[1][0], idx[0], scale, sink=z, dv=dv, backend=backend,
                                   indexer_loss=handle)
    else:
        out = ops.sparse_attention(leaves[0], leaves[1], idx, scale, sink=z, dv=dv, backend=backend,
                                   indexer_loss=handle)
    assert handle.value is None  # computed by the backward
    grads = torch.autograd.grad(out.sum(), leaves)
    assert len(seen) == 1 and seen[0] is handle.value
    return out.detach(), handle.value, grads


@pytest.mark.parametrize("b,s,skv,h,dqk,dv,k,sink", [
    (1, 23, 40, 4, 24, 16, 9, False),
    (2, 11, 30, 3, 16, 16, 7, True),   # batched: indexer tensors packed over the batch
    (1, 5, 3, 2, 8, 8, 6, True),       # k > Skv
])
def test_fused_matches_unfused_reference_fp64(b, s, skv, h, dqk, dv, k, sink):
    q, kv, idx, iq, ik, w, z = _inputs(b, s, skv, h, dqk, k, 3, 8, sink)
    out_u, loss_u, g_u = _unfused(q, kv, idx, iq, ik, w, z, 0.3, dv, 0.7)
    out_f, loss_f, g_f = _fused(q, kv, idx, iq, ik, w, z, 0.3, dv, 0.7, "torch")
    assert torch.equal(out_f, out_u)
    assert abs(loss_f.item() - loss_u.item()) < 1e-12
    for name, a, e in zip(("q", "kv", "index_q", "index_k", "weights"), g_f, g_u):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, e) < 1e-12, name
    assert g_f[2].abs().sum() > 0  # the loss did reach the indexer


def test_packed_layout_and_callable_weight():
    q, kv, idx, iq, ik, w, z = _inputs(1, 17, 17, 2, 16, 5, 2, 8, True)
    scale_t = torch.tensor(0.25, dtype=torch.float64)
    _, loss_b, g_b = _fused(q, kv, idx, iq, ik, w, z, 0.5, 16, lambda: scale_t, "torch")
    _, loss_p, g_p = _fused(q, kv, idx, iq, ik, w, z, 0.5, 16, 0.25, "torch", packed=True)
    assert loss_b.item() == loss_p.item()
    for a, e in zip(g_b, g_p):
        assert torch.equal(a.reshape(e.shape), e)
    # weight 0: the attention gradients alone, no indexer gradient
    _, _, g0 = _fused(q, kv, idx, iq, ik, w, z, 0.5, 16, 0.0, "torch")
    assert all((g == 0).all() for g in g0[2:])


def test_rows_without_keys_give_zero_loss():
    q, kv, idx, iq, ik, w, z = _inputs(1, 6, 8, 2, 8, 4, 2, 8, False)
    idx = torch.full_like(idx, -1)
    _, loss, g = _fused(q, kv, idx, iq, ik, w, z, 0.5, 8, 1.0, "torch")
    assert loss.item() == 0.0
    assert all(torch.isfinite(t).all() and (t == 0).all() for t in g)


def test_bad_inputs_name_the_tensor():
    q, kv, idx, iq, ik, w, z = _inputs(2, 5, 7, 2, 8, 3, 2, 8, False)
    with pytest.raises(ValueError, match="index_q"):
        ops.sparse_attention(q, kv, idx, 0.5, indexer_loss=ops.FusedIndexerLoss(iq[:5], ik, w[:5]))
    with pytest.raises(ValueError, match="index_k"):
        ops.sparse_attention(q, kv, idx, 0.5, indexer_loss=ops.FusedIndexerLoss(iq, ik[:7], w))
    with pytest.raises(ValueError, match="weights"):
        ops.FusedIndexerLoss(iq, ik, w[:, :1])
    with pytest.raises(ValueError, match="return_lse"):
        ops.sparse_attention(q, kv, idx, 0.5, return_lse=True, indexer_loss=ops.FusedIndexerLoss(iq, ik, w))
    with pytest.raises(TypeError, match="FusedIndexerLoss"):
        ops.sparse_attention(q, kv, idx, 0.5, indexer_loss=(iq, ik, w))
    with pytest.raises(TypeError, match="weight"):
        ops.FusedIndexerLoss(iq, ik, w, weight="0.1")


def test_sparse_mla_passes_the_loss_through():
    q, kv, idx, iq, ik, w, _ = _inputs(1, 9, 12, 2, 24, 5, 2, 8, False)
    w_vc = torch.randn(2, 8, 16, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (iq, ik, w)]
    handle = ops.FusedIndexerLoss(*leaves, weight=1.0)
    out = ops.sparse_mla(q[0], kv[0], idx[0], w_vc, 0.3, backend="torch", indexer_loss=handle)
    out.sum().backward()
    assert handle.value is not None and handle.value.item() > 0
    assert leaves[0].grad is not None and leaves[0].grad.abs().sum() > 0


# ----------------------------------------------------------------------------- GPU (kernels)

GPU_SHAPES = [
    # (b, s, skv, h, dqk, dv, k, sink, hi)
    (1, 64, 96, 64, 576, 512, 100, False, 64),    # GLM-5 heads, k not a multiple of the block
    (1, 37, 300, 128, 576, 512, 2048 + 5, False, 64),  # V3.2 heads, k > Skv
    (2, 19, 50, 16, 576, 512, 33, False, 32),     # TP shard, GLM-5 index heads
    (1, 40, 70, 64, 512, 512, 64, True, 64),      # V4 dims with sink
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"B{s[0]}S{s[1]}H{s[3]}D{s[4]}K{s[6]}{'sink' if s[7] else ''}")
def test_fused_kernels_match_fp64_oracle(shape):
    b, s, skv, h, dqk, dv, k, sink, hi = shape
    q, kv, idx, iq, ik, w, z = _inputs(b, s, skv, h, dqk, k, hi, 128, sink, dtype=torch.bfloat16, device="cuda")
    scale = dqk ** -0.5
    out_f, loss_f, g_f = _fused(q, kv, idx, iq, ik, w, z, scale, dv, 0.5, "tilelang")
    to64 = [t.double() for t in (q, kv, iq, ik, w)]
    out_u, loss_u, g_u = _unfused(*to64[:2], idx, *to64[2:], None if z is None else z.double(), scale, dv, 0.5)
    assert rel_err(out_f.float(), out_u) < 1e-2
    assert abs(loss_f.item() - loss_u.item()) <= 2e-2 * abs(loss_u.item()) + 1e-4, (loss_f.item(), loss_u.item())
    for name, a, e in zip(("q", "kv", "index_q", "index_k", "weights"), g_f, g_u):
        assert rel_err(a.float(), e) < 3e-2, name


def test_row_weights_replace_the_mean():
    """row_weights: each row's factor (Megatron: 1 / n_valid on real tokens, 0 on padding). The loss and
    the indexer gradients equal the weighted sum of the per-row losses, in float64."""
    b, s, skv, h, dqk, dv, k = 1, 13, 20, 3, 16, 16, 5
    q, kv, idx, iq, ik, w, _ = _inputs(b, s, skv, h, dqk, k, 3, 8, False, seed=7)
    rw = torch.rand(b * s, dtype=torch.float64)
    rw[3] = 0.0  # a padding row
    leaves = [t.detach().clone().requires_grad_() for t in (q, kv, iq, ik, w)]
    handle = ops.FusedIndexerLoss(leaves[2], leaves[3], leaves[4], weight=0.5, row_weights=rw)
    out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.3, dv=dv, backend="torch", indexer_loss=handle)
    grads = torch.autograd.grad(out.sum(), leaves[2:])
    # oracle: the per-row reference losses (mean over one row = that row's KL), weighted
    ref_leaves = [t.detach().clone().requires_grad_() for t in (iq, ik, w)]
    _, lse = ops.sparse_attention(q, kv, idx, 0.3, dv=dv, backend="torch", return_lse=True)
    rows = torch.where((idx >= 0) & (idx < skv), idx, -1).reshape(b * s, -1)
    total = 0
    for t in range(b * s):
        one = torch.zeros(b * s, dtype=torch.float64)
        one[t] = 1.0
        total = total + rw[t] * indexer_kl_loss_reference(
            *ref_leaves, q.reshape(b * s, h, dqk), kv.reshape(b * skv, dqk), lse.reshape(b * s, h), 0.3,
            topk_indices=rows, row_weights=one)
    ref_grads = torch.autograd.grad(0.5 * total, ref_leaves)
    assert abs(handle.value.item() - total.item()) < 1e-12
    for a, e in zip(grads, ref_grads):
        assert rel_err(a, e) < 1e-12
    with pytest.raises(ValueError, match="row_weights"):
        ops.FusedIndexerLoss(iq, ik, w, row_weights=torch.ones(b * s + 1, dtype=torch.float64))
