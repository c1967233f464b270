"""Public indexer ops on the reference path."""

import pytest
import torch

import dsa_plugins
from dsa_plugins import ops
from dsa_plugins.reference import indexer_scores


def _indexer_inputs(t, hi=4, di=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(t, hi, di, generator=g)
    ik = torch.randn(t, di, generator=g)
    w = torch.rand(t, hi, generator=g) + 0.1  # positive weights: fewer exact ties at 0
    return iq, ik, w


def _check_topk(got, scores, start, end, topk):
    for row in range(got.shape[0]):
        n = int(end[row] - start[row])
        chosen = [v for v in got[row].tolist() if v >= 0]
        assert len(set(chosen)) == len(chosen) == min(n, topk)
        assert all(start[row] <= v < end[row] for v in chosen)
        best = torch.topk(scores[row], min(n, topk)).values if n else scores.new_zeros(0)
        torch.testing.assert_close(scores[row, chosen].sort().values, best.sort().values)


@pytest.mark.parametrize("topk", [1, 5, 64])
def test_tilelang_indexer_topk_varlen(topk):
    cu = torch.tensor([0, 4, 5, 21, 40], dtype=torch.int32)
    iq, ik, w = _indexer_inputs(40, seed=topk)
    got = dsa_plugins.tilelang_indexer_topk(iq.bfloat16(), ik.bfloat16(), w, cu, topk)
    assert got.shape == (40, 1, topk) and got.dtype == torch.int32
    start, end = ops.causal_key_windows(cu)
    scores = indexer_scores(iq.bfloat16(), ik.bfloat16(), w, start, end)
    _check_topk(got[:, 0], scores, start, end, topk)


def test_tilelang_indexer_topk_context_parallel_shard():
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    cu_padded = torch.tensor([0, 8, 16], dtype=torch.int32)
    iq_all, ik, w_all = _indexer_inputs(16, seed=3)
    local = torch.tensor([1, 2, 9, 14, 15, 6])  # a CP rank's query rows (global padded ids); 6 and 15 are padding
    got = dsa_plugins.tilelang_indexer_topk(iq_all[local], ik, w_all[local], cu, 4, local, cu_padded)
    start, end = ops.causal_key_windows(cu, cu_padded, local)
    assert start.tolist() == [0, 0, 8, 8, 8, 0] and end.tolist() == [2, 3, 10, 15, 15, 6]
    scores = indexer_scores(iq_all[local], ik, w_all[local], start, end)
    _check_topk(got[:, 0], scores, start, end, 4)
    assert not any(v in (6, 7, 15) for v in got.flatten().tolist())  # padding keys are never selected


def test_fp8_indexer_reference_path():
    """fp8 q/k with per-key scales: the selected keys are the top-k of the scores of the quantised values
    (recomputed here in float64 from the dequantised tensors), and those scores track the unquantised ones."""
    t, hi, di, topk = 48, 4, 32, 7
    iq, ik, w = _indexer_inputs(t, hi, di, seed=5)
    q8, k8, k_scale, w8 = ops.quantize_indexer_fp8(iq, ik, w)
    assert q8.dtype == k8.dtype == torch.float8_e4m3fn and k_scale.shape == (t,) and w8.shape == (t, hi)
    start, end = ops.causal_key_windows(torch.tensor([0, 20, t]))
    got = ops.indexer_topk(q8, k8, w8, topk, start, end, backend="torch", index_k_scale=k_scale)
    scores = torch.einsum("thd,sd->ths", q8.double(), k8.double() * k_scale.double()[:, None]).relu()
    scores = (scores * w8.double()[:, :, None]).sum(1)
    cols = torch.arange(t)
    scores = scores.masked_fill((cols[None] < start[:, None]) | (cols[None] >= end[:, None]), float("-inf"))
    _check_topk(got, scores, start, end, topk)
    exact = indexer_scores(iq.double(), ik.double(), w.double(), start, end)
    finite = exact.isfinite()
    err = (scores[finite] - exact[finite]).abs().max() / exact[finite].abs().max()
    assert 0 < err < 0.1  # e4m3 keeps 3 mantissa bits: close, not equal
    # the custom op's fake (torch.compile); opcheck's schema test cannot multiply fp8 tensors on CPU
    torch.library.opcheck(torch.ops.dsa_plugins.indexer_topk.default,
                          (q8, k8, w8, start, end, topk, "torch", k_scale),
                          test_utils=("test_faketensor", "test_autograd_registration"))


def test_fp8_indexer_errors(monkeypatch):
    iq, ik, w = _indexer_inputs(6, 2, 32)
    q8, k8, k_scale, w8 = ops.quantize_indexer_fp8(iq, ik, w)
    start, end = ops.causal_key_windows(torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="index_k_scale goes with float8_e4m3fn"):
        ops.indexer_topk(iq.bfloat16(), ik.bfloat16(), w, 2, start, end, index_k_scale=k_scale)
    with pytest.raises(ValueError, match="index_k"):
        ops.indexer_topk(q8, ik.bfloat16(), w8, 2, start, end, index_k_scale=k_scale)
    with pytest.raises(ValueError, match="index_k_scale"):
        ops.indexer_topk(q8, k8, w8, 2, start, end, index_k_scale=k_scale[:5])
    with pytest.raises(ValueError, match="index_k_scale .* is required"):
        ops.indexer_topk(q8, k8, w8, 2, start, end)
    bad_q = iq.clone()
    bad_q[2, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="index_q has non-finite"):
        ops.quantize_indexer_fp8(bad_q, ik, w)
    # a strided scale is fine; a non-positive one is rejected when checks are on
    strided = torch.stack([k_scale, k_scale], 1)[:, 0]
    assert ops.indexer_topk(q8, k8, w8, 2, start, end, index_k_scale=strided).shape == (6, 2)
    zero = k_scale.clone()
    zero[1] = 0
    ops.indexer_topk(q8, k8, w8, 2, start, end, index_k_scale=zero)  # unchecked by default (no sync)
    monkeypatch.setenv("DSA_PLUGINS_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match="positive and finite"):
        ops.indexer_topk(q8, k8, w8, 2, start, end, index_k_scale=zero)


def test_quantize_fp8_rows_edges():
    from dsa_plugins.reference.indexer import quantize_fp8_rows

    x = torch.tensor([[0.0, 0.0, 0.0], [1e-44, 0.0, -1e-44], [1000.0, -3.0, 0.5]])
    x8, scale = quantize_fp8_rows(x)
    assert torch.isfinite(x8.float()).all() and (scale > 0).all() and scale[0] == 1
    torch.testing.assert_close((x8.float() * scale[:, None])[2], x[2], rtol=0.07, atol=0)
    assert x8.float().abs().max() <= 448


def test_topk_rows_op():
    scores = torch.randn(3, 20)
    got = ops.topk_rows(scores, torch.tensor([20, 2, 0], dtype=torch.int32), 4)
    assert set(got[0].tolist()) == set(torch.topk(scores[0], 4).indices.tolist())
    assert sorted(got[1].tolist()) == [-1, -1, 0, 1] and (got[2] == -1).all()


def test_indexer_topk_opcheck():
    iq, ik, w = _indexer_inputs(9)
    start, end = ops.causal_key_windows(torch.tensor([0, 9]))
    torch.library.opcheck(torch.ops.dsa_plugins.indexer_topk.default, (iq, ik, w, start, end, 3, "torch"))


def test_indexer_kl_loss_op_sparse_and_dense():
    t, h, d = 8, 2, 6
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, 1, d, generator=g)
    iq, ik, w = (x.requires_grad_() for x in _indexer_inputs(t))
    start, end = ops.causal_key_windows(torch.tensor([0, t]))
    idx = ops.indexer_topk(iq.detach(), ik.detach(), w.detach(), 3, start, end)
    sparse = ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, topk_indices=idx.unsqueeze(1))
    dense = ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, key_start=start, key_end=end)
    (sparse + dense).backward()
    assert sparse.ndim == 0 and torch.isfinite(sparse) and torch.isfinite(dense)
    assert all(torch.isfinite(x.grad).all() for x in (iq, ik, w))
    with pytest.raises(ValueError, match="topk_indices .sparse. or key_start and key_end"):
        ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4)


def test_windows_and_lengths_out_of_range_are_clamped_to_the_keys():
    """Window bounds and row lengths outside the keys mean the keys' own ends: int64 values past int32 do not
    wrap (2**32 + 2 is not 2), and the dense loss clamps its windows as indexer_topk does (a start of -1 does
    not reach the last key, an end past Tk does not fail)."""
    t = 7
    iq, ik, w = _indexer_inputs(t)
    start = torch.zeros(t, dtype=torch.int64)
    end = torch.full((t,), t, dtype=torch.int64)
    want = ops.indexer_topk(iq, ik, w, 3, start, end)
    for s, e in ((start, end + 2**32 - t + 2), (start - 2**32 + 1, end), (start - 5, end + 9)):
        assert torch.equal(ops.indexer_topk(iq, ik, w, 3, s, e), want)
        assert torch.equal(ops.indexer_topk(iq[None], ik[None], w[None], 3, s, e)[0], want)  # batched
    scores = torch.randn(3, 20)
    assert torch.equal(ops.topk_rows(scores, torch.full((3,), 2**32, dtype=torch.int64), 4),
                       ops.topk_rows(scores, None, 4))
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(t, 2, 6, generator=g), torch.randn(t, 6, generator=g)
    ks, ke = ops.causal_key_windows(torch.tensor([0, t]))

    def dense_loss(key_start, key_end):
        return ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, key_start=key_start, key_end=key_end)

    for below in (1, 3):
        torch.testing.assert_close(dense_loss(ks - below, ke), dense_loss(ks, ke))
    torch.testing.assert_close(dense_loss(ks, torch.full((t,), t + 5)), dense_loss(ks, torch.full((t,), t)))


def test_batched_layout_without_rows_or_keys_and_a_wrong_scale_shape():
    """The batched layout with no query row (B or S 0) or no key in any entry (Tk 0): every slot -1 (lse -inf); a
    per-key scale of the wrong shape is an error naming it."""
    iq, ik, w = _indexer_inputs(4)
    iq2, ik2, w2 = iq[None].expand(2, -1, -1, -1), ik[None].expand(2, -1, -1), w[None].expand(2, -1, -1)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 4, dtype=torch.int32)
    for qq, kk, ww, shape in ((iq2[:, :0], ik2, w2[:, :0], (2, 0, 3)), (iq2[:0], ik2[:0], w2[:0], (0, 4, 3)),
                              (iq2, ik2[:, :0], w2, (2, 4, 3))):
        wins = (ks[: shape[1]], ke[: shape[1]].clamp(max=kk.shape[1]))
        rows, lse = ops.indexer_topk(qq, kk, ww, 3, *wins, return_lse=True)
        assert rows.shape == shape and (rows == -1).all() and torch.isneginf(lse).all()
        with pytest.raises(ValueError, match="topk must be >= 1"):
            ops.indexer_topk(qq, kk, ww, 0, *wins)
    q8, k8, k_scale, w8 = ops.quantize_indexer_fp8(iq, ik, w)
    with pytest.raises(ValueError, match="index_k_scale must have"):
        ops.indexer_topk(q8[None].expand(2, -1, -1, -1), k8[None].expand(2, -1, -1), w8[None].expand(2, -1, -1), 2,
                         ks, ke, index_k_scale=k_scale[:3])


def test_loss_without_rows_or_keys_and_window_checks():
    """indexer_kl_loss with no query row (sparse and dense), no key, or empty windows at the keys' end: a finite
    loss (0 where nothing is selected), no indexing error; causal_key_windows names a bad cu_seqlens."""
    t, g = 5, torch.Generator().manual_seed(2)
    iq, ik, w = _indexer_inputs(t)
    q, kv = torch.randn(t, 2, 6, generator=g), torch.randn(t, 6, generator=g)
    idx = torch.randint(-1, t, (t, 3), generator=g, dtype=torch.int32)
    none, at_end = torch.zeros(t, dtype=torch.int32), torch.full((t,), t, dtype=torch.int32)
    cases = [dict(args=(iq[:0], ik, w[:0], q[:0], kv), topk_indices=idx[:0]),
             dict(args=(iq[:0], ik, w[:0], q[:0], kv), key_start=none[:0], key_end=none[:0]),
             dict(args=(iq, ik[:0], w, q, kv[:0]), topk_indices=torch.full((t, 3), -1, dtype=torch.int32)),
             dict(args=(iq, ik[:0], w, q, kv[:0]), key_start=none, key_end=none),
             dict(args=(iq, ik, w, q, kv), key_start=at_end, key_end=at_end)]
    for case in cases:
        args = case.pop("args")
        loss = ops.indexer_kl_loss(*args, None, 0.4, **case)
        assert torch.isfinite(loss) and loss == 0, case
    for bad in (torch.tensor([], dtype=torch.int32), torch.tensor([[0, 3]]), [0, 3]):
        with pytest.raises(ValueError, match="cu_seqlens must be a 1-D tensor"):
            ops.causal_key_windows(bad)


def test_indexer_topk_return_lse():
    """return_lse: the rows of the plain call and each row's logsumexp over the scores of its selected keys
    (-inf for an empty window); batched: [B, S]; the op's fake and real outputs agree (opcheck); the loss
    takes it (sparse stage only) and a wrong shape is named."""
    iq, ik, w = _indexer_inputs(10, seed=4)
    start, end = ops.causal_key_windows(torch.tensor([0, 10]))
    end = end.clone()
    end[3] = start[3]  # an empty window
    rows, lse = ops.indexer_topk(iq, ik, w, 4, start, end, return_lse=True)
    assert torch.equal(rows, ops.indexer_topk(iq, ik, w, 4, start, end))
    scores = indexer_scores(iq, ik, w, start, end)
    want = torch.logsumexp(scores.gather(1, rows.long().clamp(min=0)).masked_fill(rows < 0, float("-inf")), 1)
    assert lse.dtype == torch.float32 and lse[3] == float("-inf")
    torch.testing.assert_close(lse, want.float())
    torch.library.opcheck(torch.ops.dsa_plugins.indexer_topk_lse.default, (iq, ik, w, start, end, 4, "torch"))
    b_rows, b_lse = ops.indexer_topk(iq.view(2, 5, 4, 8), ik.view(2, 5, 8), w.view(2, 5, 4), 3,
                                     torch.zeros(5, dtype=torch.int32), torch.arange(1, 6, dtype=torch.int32),
                                     return_lse=True)
    assert b_rows.shape == (2, 5, 3) and b_lse.shape == (2, 5) and torch.isfinite(b_lse).all()
    t, h, d = 10, 2, 6
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, d, generator=g)
    loss = ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, topk_indices=rows, index_lse=lse)
    assert torch.isfinite(loss)  # (the reference recomputes the lse; the kernels' use of it: GPU tests)
    with pytest.raises(ValueError, match="index_lse"):
        ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, topk_indices=rows, index_lse=lse[:-1])
    with pytest.raises(ValueError, match="index_lse goes with topk_indices"):
        ops.indexer_kl_loss(iq, ik, w, q, kv, None, 0.4, key_start=start, key_end=end, index_lse=lse)
    with pytest.raises(ValueError, match="index_lse"):
        ops.FusedIndexerLoss(iq, ik, w, index_lse=lse[None])


def test_windows_may_be_broadcast_views():
    """key_start/key_end built with expand() (stride 0), as adapters do for one batch row."""
    iq, ik, w = _indexer_inputs(6)
    start = torch.zeros(1, dtype=torch.int32).expand(6)
    end = torch.arange(1, 7, dtype=torch.int32)
    got = ops.indexer_topk(iq, ik, w, 3, start, end)
    assert got.shape == (6, 3) and (got[0, 1:] == -1).all()


def test_batched_layout_equals_each_entry_packed():
    """index_q [B, S, Hi, Di] with per-entry keys and windows: each entry's rows as its own packed call."""
    g = torch.Generator().manual_seed(2)
    b, s, tk, hi, di, k = 3, 7, 11, 4, 8, 5
    iq = torch.randn(b, s, hi, di, generator=g)
    ik = torch.randn(b, tk, di, generator=g)
    w = torch.rand(b, s, hi, generator=g)
    end = torch.randint(0, tk + 1, (b, s), generator=g).to(torch.int32)
    start = (end - torch.randint(0, 6, (b, s), generator=g)).clamp(min=0).to(torch.int32)
    out = ops.indexer_topk(iq, ik, w, k, start, end)
    assert out.shape == (b, s, k)
    for i in range(b):
        want = ops.indexer_topk(iq[i], ik[i], w[i], k, start[i], end[i])
        assert torch.equal(out[i].sort(-1).values, want.sort(-1).values)
    shared = ops.indexer_topk(iq, ik, w, k, start[0], end[0])  # [S] windows shared by the batch
    assert torch.equal(shared[1].sort(-1).values, ops.indexer_topk(iq[1], ik[1], w[1], k, start[0], end[0]).sort(-1).values)
    with pytest.raises(ValueError, match="index_k"):
        ops.indexer_topk(iq, ik[:2], w, k, start, end)
