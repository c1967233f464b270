"""The torch reference (the oracle and the CPU path): canonical top-k selection and NaN that
propagates while empty rows stay exactly zero."""

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.reference.indexer import indexer_topk_reference, topk_rows_reference
from dsa_plugins.reference.indexer_loss import indexer_kl_loss_reference
from dsa_plugins.reference.sparse_attention import sparse_attention_reference
from tests.helpers import random_indices


def _oracle(row: torch.Tensor, k: int) -> list[int]:
    """Score descending, then column ascending; -0.0 == +0.0; -inf is not selectable."""
    keyed = [(-float(v), c) for c, v in enumerate(row.tolist()) if v != float("-inf")]
    return [c for _, c in sorted(keyed)[:k]]


@pytest.mark.parametrize("kind", ["zeros", "mixed_zeros", "few_values", "boundary"])
@pytest.mark.parametrize("k", [1, 2, 7, 64, 500])
def test_topk_lowest_index_wins_among_ties(kind, k):
    g = torch.Generator().manual_seed(k)
    n = 300
    if kind == "zeros":
        x = torch.zeros(5, n)
    elif kind == "mixed_zeros":
        x = torch.zeros(5, n)
        x[torch.rand(5, n, generator=g) < 0.5] = -0.0
        x[:, 17] = 1.0
    elif kind == "few_values":
        x = torch.randint(-2, 3, (5, n), generator=g).float()
    else:  # the k-th value is shared across the boundary
        x = torch.arange(n, 0, -1).float().repeat(5, 1)
        x[:, min(k, n) - 1 :: 3] = x[0, min(k, n) - 1]
    lengths = torch.tensor([n, n - 1, k, 0, 150])
    out = topk_rows_reference(x, lengths, k)
    for r in range(5):
        want = _oracle(x[r, : int(lengths[r])], k)
        got = out[r][out[r] >= 0].tolist()
        assert got == want  # the reference also sorts: score descending, then column
        assert (out[r][len(want):] == -1).all()


def test_topk_selection_is_a_function_of_the_row_alone():
    """A row packed among other rows, behind other sequences, or alone: the same keys."""
    g = torch.Generator().manual_seed(0)
    hi, di = 4, 8
    iq = torch.randint(-1, 2, (60, hi, di), generator=g).float()
    pool = torch.randint(-1, 2, (3, di), generator=g).float()  # 3 distinct keys: exact ties everywhere
    ik = pool[torch.randint(0, 3, (60,), generator=g)]
    w = torch.ones(60, hi)
    start = torch.tensor([0] * 30 + [30] * 30, dtype=torch.int32)
    end = torch.cat([torch.arange(1, 31), torch.arange(31, 61)]).to(torch.int32)
    packed = indexer_topk_reference(iq, ik, w, 8, start, end)
    alone = indexer_topk_reference(iq[30:], ik[30:], w[30:], 8, start[30:] - 30, end[30:] - 30)
    assert torch.equal(packed[30:], torch.where(alone >= 0, alone + 30, alone))
    one = indexer_topk_reference(iq[45:46], ik, w[45:46], 8, start[45:46], end[45:46])
    assert torch.equal(one, packed[45:46])


def _attention_inputs(seed=0, sink=True):
    g = torch.Generator().manual_seed(seed)
    b, s, h, d, skv, k = 2, 9, 3, 12, 20, 6
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(b, skv, d, generator=g, dtype=torch.float64)
    idx = random_indices(b, s, k, skv, generator=g, empty_rows=2)
    z = torch.randn(h, generator=g, dtype=torch.float64) if sink else None
    empty = ((idx < 0) | (idx >= skv)).all(-1)
    return q, kv, idx, z, empty


def _run(q, kv, idx, z, dout):
    leaves = [t.clone().requires_grad_() for t in (q, kv, z)]
    out, lse = sparse_attention_reference(leaves[0], leaves[1], idx, 0.3, leaves[2], 8)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse, *grads


def test_nan_in_one_query_head_reaches_that_head_only():
    """The issue's case: q[0, 1, 0, 0] = nan made that row exactly 0 and hid the divergence."""
    q, kv, idx, z, empty = _attention_inputs()
    row = int((~empty[0]).nonzero()[0])
    q[0, row, 0, 0] = float("nan")
    dout = torch.randn(*q.shape[:-1], 8, dtype=torch.float64)
    out, lse, dq, dkv, dsink = _run(q, kv, idx, z, dout)
    assert torch.isnan(out[0, row, 0]).all() and torch.isnan(lse[0, row, 0])
    clean = _run(*_attention_inputs()[:4], dout)
    others = torch.ones_like(lse, dtype=torch.bool)
    others[0, row, 0] = False
    assert torch.equal(out[others], clean[0][others]) and torch.equal(lse[others], clean[1][others])
    assert torch.isnan(dq[0, row, 0]).all() and torch.isnan(dsink[0])
    sel = idx[0, row][(idx[0, row] >= 0) & (idx[0, row] < kv.shape[1])].long()
    assert torch.isnan(dkv[0, sel]).any(-1).all()  # every selected kv row of that query


@pytest.mark.parametrize("where", ["kv_selected", "kv_placeholder", "sink", "dout", "empty_row_q"])
def test_nan_reaches_what_it_touches_and_empty_rows_stay_zero(where):
    q, kv, idx, z, empty = _attention_inputs(seed=1)
    dout = torch.randn(*q.shape[:-1], 8, dtype=torch.float64)
    erow = int(empty[0].nonzero()[0])
    row = int((~empty[0]).nonzero()[0])
    sel = idx[0, row][(idx[0, row] >= 0) & (idx[0, row] < kv.shape[1])].long()
    if where == "kv_selected":
        kv[0, sel[0]] = float("nan")
    elif where == "kv_placeholder":  # row 0 of batch 1 stands in for invalid slots: never read
        idx[1] = torch.where(idx[1] == 0, torch.full_like(idx[1], -1), idx[1])
        empty = ((idx < 0) | (idx >= kv.shape[1])).all(-1)
        kv[1, 0] = float("nan")
    elif where == "sink":
        z[1] = float("nan")
    elif where == "dout":
        dout[0, row, 2, 3] = float("nan")
        dout[0, erow] = float("nan")
    elif where == "empty_row_q":
        q[0, erow] = float("nan")
    out, lse, dq, dkv, dsink = _run(q, kv, idx, z, dout)
    # empty rows: exactly 0 out, +inf lse, zero dq, whatever else carries NaN
    assert (out[empty] == 0).all() and torch.isinf(lse[empty]).all() and (dq[empty] == 0).all()
    nan_out = torch.isnan(out).any(-1)
    if where == "kv_selected":
        assert nan_out[0, row].all()
    elif where == "kv_placeholder" or where == "empty_row_q":
        assert not nan_out.any() and not torch.isnan(dq).any() and not torch.isnan(dkv).any()
    elif where == "sink":
        assert nan_out[..., 1][~empty].all() and not nan_out[..., [0, 2]].any() and torch.isnan(dsink[1])
    elif where == "dout":
        assert not nan_out.any() and torch.isnan(dq[0, row, 2]).all() and not torch.isnan(dq[0, row, [0, 1]]).any()
        assert torch.isnan(dkv[0, sel]).any(-1).all()


def test_op_level_nan_on_the_cpu_path():
    """The public op (torch backend) shows NaN too (it was scrubbed to 0 before)."""
    q, kv, idx, _, empty = _attention_inputs(sink=False)
    row = int((~empty[0]).nonzero()[0])
    q[0, row, 0, 0] = float("nan")
    out = ops.sparse_attention(q.float(), kv.float(), idx, 0.3, backend="torch")
    assert torch.isnan(out[0, row, 0]).all() and (out[empty] == 0).all()


@pytest.mark.parametrize("where", ["attn_q", "index_q", "index_k_placeholder", "index_q_empty_row"])
def test_indexer_loss_nan(where):
    g = torch.Generator().manual_seed(3)
    t, h, d, hi, di, k = 10, 2, 8, 3, 4, 5
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(t, d, generator=g, dtype=torch.float64)
    iq = torch.randn(t, hi, di, generator=g, dtype=torch.float64)
    ik = torch.randn(t, di, generator=g, dtype=torch.float64)
    w = torch.rand(t, hi, generator=g, dtype=torch.float64)
    idx = random_indices(1, t, k, t, generator=g, out_of_range=False, dup_frac=0, empty_rows=2)[0]
    empty = (idx < 0).all(-1)
    erow = int(empty.nonzero()[0])
    if where == "attn_q":
        q[int((~empty).nonzero()[0])] = float("nan")
    elif where == "index_q":
        iq[int((~empty).nonzero()[0]), 0, 0] = float("nan")
    elif where == "index_k_placeholder":  # index_k row 0 stands in for -1 slots; no row selects it
        idx = torch.where(idx == 0, torch.full_like(idx, -1), idx)
        ik[0] = float("nan")
    elif where == "index_q_empty_row":
        iq[erow] = float("nan")
    leaves = [x.clone().requires_grad_() for x in (iq, ik, w)]
    loss = indexer_kl_loss_reference(*leaves, q, kv, None, 0.3, topk_indices=idx)
    loss.backward()
    expect_nan = where in ("attn_q", "index_q")
    assert bool(torch.isnan(loss)) == expect_nan
    if not expect_nan:
        assert all(torch.isfinite(x.grad).all() for x in leaves)
    assert (leaves[0].grad[empty] == 0).all()
    assert (leaves[2].grad[empty] == 0).all()


def test_context_parallel_shards_select_what_the_full_run_selects():
    """Zigzag CP shards (query rows of two ranks over the all-gathered keys) under exact ties."""
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 24, 40])
    T_ = 40
    iq = torch.randint(-1, 2, (T_, 4, 8), generator=g).float()
    ik = torch.randint(-1, 2, (2, 8), generator=g).float()[torch.randint(0, 2, (T_,), generator=g)]
    w = torch.ones(T_, 4)
    full = ops.tilelang_indexer_topk(iq, ik, w, cu, 6)
    chunks = torch.arange(T_).view(4, 10)  # CP 2 zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    for rank_rows in (torch.cat([chunks[0], chunks[3]]), torch.cat([chunks[1], chunks[2]])):
        shard = ops.tilelang_indexer_topk(iq[rank_rows], ik, w[rank_rows], cu, 6, query_indices=rank_rows)
        assert torch.equal(shard.sort(-1).values, full[rank_rows].sort(-1).values)
