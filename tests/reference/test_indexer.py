"""Indexer top-k, windows and top-k rows against brute force."""

import pytest
import torch

from dsa_plugins.reference import causal_key_windows, indexer_scores, indexer_topk_reference, topk_rows_reference
import dsa_plugins.reference.indexer as indexer_mod


def _brute_windows(cu, cu_padded=None):
    cu = cu.tolist()
    offs = cu if cu_padded is None else cu_padded.tolist()
    total = offs[-1]
    start, end = [0] * total, [0] * total
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        for p in range(offs[i], offs[i + 1]):
            start[p] = offs[i]
            end[p] = min(p + 1, offs[i] + length)
    return torch.tensor(start), torch.tensor(end)


def test_causal_windows_plain_and_padded():
    cu = torch.tensor([0, 3, 3, 8, 9])
    s, e = causal_key_windows(cu)
    bs, be = _brute_windows(cu)
    assert torch.equal(s.long(), bs) and torch.equal(e.long(), be)
    padded = torch.tensor([0, 4, 4, 12, 16])
    s, e = causal_key_windows(cu, padded)
    bs, be = _brute_windows(cu, padded)
    assert torch.equal(s.long(), bs) and torch.equal(e.long(), be)
    q_idx = torch.tensor([13, 0, 5, 11])
    s2, e2 = causal_key_windows(cu, padded, q_idx)
    assert torch.equal(s2.long(), bs[q_idx]) and torch.equal(e2.long(), be[q_idx])
    assert s.dtype == torch.int32 and e.dtype == torch.int32


@pytest.mark.parametrize("topk", [1, 3, 16, 40])
def test_indexer_topk_varlen_against_dense(topk, monkeypatch):
    monkeypatch.setattr(indexer_mod, "_CHUNK_ELEMS", 512)  # many small chunks
    g = torch.Generator().manual_seed(topk)
    cu = torch.tensor([0, 1, 6, 30, 31, 45])
    t, hi, di = 45, 4, 8
    iq = torch.randn(t, hi, di, generator=g, dtype=torch.float64)
    ik = torch.randn(t, di, generator=g, dtype=torch.float64)
    w = torch.randn(t, hi, generator=g, dtype=torch.float64)
    start, end = causal_key_windows(cu)
    got = indexer_topk_reference(iq, ik, w, topk, start, end)
    assert got.shape == (t, topk) and got.dtype == torch.int32
    dense = indexer_scores(iq, ik, w, start, end)
    for row in range(t):
        n = int(end[row] - start[row])
        chosen = [v for v in got[row].tolist() if v >= 0]
        assert len(set(chosen)) == len(chosen) == min(topk, n)
        # ties (relu makes many scores exactly 0) allow other sets: compare the selected scores
        expect = torch.topk(dense[row], min(topk, n)).values if n else dense.new_zeros(0)
        torch.testing.assert_close(dense[row, chosen].sort().values, expect.sort().values)
        assert int((got[row] == -1).sum()) == max(topk - n, 0)
        assert all(start[row] <= v < end[row] for v in got[row].tolist() if v >= 0)


def test_indexer_scores_formula():
    iq = torch.randn(2, 3, 4, dtype=torch.float64)
    ik = torch.randn(5, 4, dtype=torch.float64)
    w = torch.randn(2, 3, dtype=torch.float64)
    s = indexer_scores(iq, ik, w)
    manual = torch.zeros(2, 5, dtype=torch.float64)
    for t in range(2):
        for j in range(5):
            manual[t, j] = sum(max(float(iq[t, h] @ ik[j]), 0.0) * float(w[t, h]) for h in range(3))
    torch.testing.assert_close(s, manual)


def test_topk_rows_lengths_and_padding():
    scores = torch.randn(4, 10)
    lengths = torch.tensor([0, 3, 10, 7], dtype=torch.int32)
    got = topk_rows_reference(scores, lengths, 5)
    assert (got[0] == -1).all()
    assert set(got[1, :3].tolist()) == {0, 1, 2} and (got[1, 3:] == -1).all()
    assert set(got[2].tolist()) == set(torch.topk(scores[2], 5).indices.tolist())
    assert set(got[3].tolist()) == set(torch.topk(scores[3, :7], 5).indices.tolist())
