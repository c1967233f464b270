"""The dense (warm-up) indexer KL loss: the row chunks and slot lists that take it through the sparse
kernels (CPU), and the kernel route against the fp64 reference (GPU, skipped without one)."""

import os

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.ops.indexer import dense_loss_chunks, dense_loss_slots
from dsa_plugins.reference.indexer_loss import indexer_kl_loss_reference

from ..helpers import rel_err


def _packed_causal_windows(lengths, device="cpu"):
    """key_start/key_end [T] of packed causal sequences of the given lengths."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device)
    return ops.causal_key_windows(cu, num_tokens=int(cu[-1]))


@pytest.mark.parametrize("lengths,budget,max_rows", [
    ([37], 64, 1024), ([5, 1, 30, 9], 40, 7), ([300], 1 << 25, 64), ([3, 0, 4], 1, 1024),
])
def test_chunks_cover_every_row_once_and_slots_are_exactly_the_windows(lengths, budget, max_rows):
    start, end = _packed_causal_windows([n for n in lengths if n] or [1])
    if 0 in lengths:  # an empty window row too
        end = end.clone()
        end[1] = start[1]
    chunks = dense_loss_chunks(start, end, slots_per_chunk=budget, max_rows=max_rows)
    assert [c[0] for c in chunks] == sorted(c[0] for c in chunks) and chunks[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and chunks[-1][1] == start.shape[0]
    longest = int((end - start).max())
    for t0, t1, n in chunks:
        assert n >= int((end[t0:t1] - start[t0:t1]).max()) and n >= 1
        assert t1 - t0 <= max_rows
        assert (t1 - t0) * n <= max(budget, longest)  # over budget only when one row alone is longer
        slots = dense_loss_slots(start, end, t0, t1, n)
        assert slots.dtype == torch.int32 and slots.shape == (t1 - t0, n)
        for r in range(t1 - t0):
            want = list(range(int(start[t0 + r]), int(end[t0 + r])))
            row = slots[r].tolist()
            assert row[:len(want)] == want and all(x == -1 for x in row[len(want):])


def test_dense_loss_row_weights_on_the_reference_path():
    """row_weights replace the mean's 1/T: weights 1/T give the mean, zero weights drop rows."""
    g = torch.Generator().manual_seed(0)
    t, hi, di, h, d = 19, 4, 8, 3, 16
    iq, ik, w = torch.randn(t, hi, di, generator=g), torch.randn(t, di, generator=g), torch.rand(t, hi, generator=g)
    q, kv = torch.randn(t, h, d, generator=g), torch.randn(t, d, generator=g)
    start, end = _packed_causal_windows([12, 7])
    kw = dict(key_start=start, key_end=end, backend="torch")
    mean = ops.indexer_kl_loss(iq, ik, w, q, kv, None, d ** -0.5, **kw)
    same = ops.indexer_kl_loss(iq, ik, w, q, kv, None, d ** -0.5, row_weights=torch.full((t,), 1.0 / t), **kw)
    assert torch.allclose(mean, same, rtol=1e-6)
    drop = torch.ones(t)
    drop[12:] = 0.0
    first = ops.indexer_kl_loss(iq, ik, w, q, kv, None, d ** -0.5, row_weights=drop, **kw)
    alone = ops.indexer_kl_loss(iq[:12], ik[:12], w[:12], q[:12], kv[:12], None, d ** -0.5,
                                key_start=start[:12], key_end=end[:12], backend="torch")
    assert torch.allclose(first, alone * 12, rtol=1e-5)
    with pytest.raises(ValueError, match="row_weights"):
        ops.indexer_kl_loss(iq, ik, w, q, kv, None, d ** -0.5, row_weights=torch.ones(t + 1), **kw)


# (sequence lengths, query heads H, Dqk, index heads Hi, slots per chunk): packed sequences, odd
# lengths, every head count of the models, chunks forced small so that several run
GPU_CASES = [
    ([257], 64, 576, 64, 1 << 25),
    ([100, 1, 333, 70], 128, 576, 64, 4096),
    ([513], 16, 576, 32, 1 << 25),
    ([190, 67], 32, 512, 64, 2048),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"L{'-'.join(map(str, c[0]))}-H{c[1]}-D{c[2]}-Hi{c[3]}")
def test_dense_loss_kernel_route_matches_reference(case, monkeypatch):
    lengths, h, dqk, hi, budget = case
    from dsa_plugins.ops import indexer as ops_indexer

    monkeypatch.setattr(ops_indexer, "dense_loss_chunks",
                        lambda s, e, _f=ops_indexer.dense_loss_chunks: _f(s, e, slots_per_chunk=budget))
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    t, di = sum(lengths), 128
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(t, di, generator=g).cuda().bfloat16()
    w = (torch.rand(t, hi, generator=g) * (hi * di) ** -0.5).cuda()
    q = torch.randn(t, h, dqk, generator=g).cuda().bfloat16()
    kv = torch.randn(t, dqk, generator=g).cuda().bfloat16()
    start, end = _packed_causal_windows(lengths, "cuda")
    rw = torch.rand(t, generator=g).cuda()
    rw[3] = 0.0
    scale = dqk ** -0.5
    leaves = [x.clone().requires_grad_() for x in (iq, ik, w)]
    loss = ops.indexer_kl_loss(*leaves, q, kv, None, scale, key_start=start, key_end=end, backend="tilelang",
                               row_weights=rw)
    ref_leaves = [x.detach().double().requires_grad_() for x in (iq, ik, w)]
    ref = indexer_kl_loss_reference(*ref_leaves, q.double(), kv.double(), None, scale, key_start=start,
                                    key_end=end, row_weights=rw.double())
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item()) + 1e-5
    got = torch.autograd.grad(loss, leaves)
    want = torch.autograd.grad(ref, ref_leaves)
    for name, a, b in zip(("d_index_q", "d_index_k", "d_weights"), got, want):
        assert rel_err(a.float(), b) < 2e-2, name
