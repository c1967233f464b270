"""The dense (warm-up) indexer KL loss: the key-major work list of its gradient program (CPU), and the
blockwise kernel route against the fp64 reference (GPU, skipped without one)."""

import os

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.kernels.indexer_loss import key_block_entries
from dsa_plugins.reference.indexer_loss import indexer_kl_loss_reference

from ..helpers import rel_err


def _packed_causal_windows(lengths, device="cpu"):
    """key_start/key_end [T] of packed causal sequences of the given lengths."""
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device=device)
    return ops.causal_key_windows(cu, num_tokens=int(cu[-1]))


@pytest.mark.parametrize("ranges", [
    [(0, 1), (0, 2), (1, 3), (5, 5), (2, 4)],  # overlapping, one empty, not monotone
    [(3, 3), (7, 2)],  # no key at all
    [(4, 9)],
])
def test_key_block_entries_list_each_query_block_of_each_key_block_once(ranges):
    lo = torch.tensor([r[0] for r in ranges], dtype=torch.int32)
    hi = torch.tensor([r[1] for r in ranges], dtype=torch.int32)
    width, nkb = max(max(b - a, 0) for a, b in ranges) or 1, 12
    ptr, ent, col = key_block_entries(lo, hi, width, nkb)
    assert ptr.dtype == ent.dtype == col.dtype == torch.int32 and ptr.shape == (nkb + 1,) and int(ptr[0]) == 0
    for kb in range(nkb):
        sl = slice(int(ptr[kb]), int(ptr[kb + 1]))
        want = [qb for qb, (a, b) in enumerate(ranges) if a <= kb < b]
        assert ent[sl].tolist() == want  # ascending: the sums run in a fixed order
        assert col[sl].tolist() == [kb - ranges[qb][0] for qb in want]
    assert int(ptr[-1]) == sum(max(b - a, 0) for a, b in ranges)


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


# (sequence lengths, query heads H, Dqk, index heads Hi, chunk bytes, attn_lse given, sink): packed sequences,
# odd lengths, every head count of the models (and some the target pads: 20 -> 32, 192 -> 2 x 128), chunks
# forced small so several run
GPU_CASES = [
    ([257], 64, 576, 64, 128 << 20, False, False),
    ([100, 1, 333, 70], 128, 576, 64, 64 << 10, False, False),
    ([513], 16, 576, 32, 128 << 20, True, False),
    ([190, 67], 32, 512, 64, 32 << 10, True, False),
    ([77, 140], 64, 576, 12, 128 << 20, False, False),
    ([1000], 64, 576, 64, 1 << 20, True, False),
    ([129, 300], 128, 512, 64, 128 << 20, True, True),
    ([211, 5], 20, 576, 32, 128 << 20, False, True),
    ([150], 192, 576, 64, 128 << 20, True, False),
]


def _inputs(lengths, h, dqk, hi, seed, di=128):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(t, di, generator=g).cuda().bfloat16()
    w = (torch.rand(t, hi, generator=g) * (hi * di) ** -0.5).cuda()
    q = torch.randn(t, h, dqk, generator=g).cuda().bfloat16()
    kv = torch.randn(t, dqk, generator=g).cuda().bfloat16()
    return iq, ik, w, q, kv


def _dense_attention_lse(q, kv, start, end, scale):
    s = torch.einsum("thd,sd->ths", q.double(), kv.double()) * scale
    cols = torch.arange(kv.shape[0], device=q.device)
    mask = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
    return torch.logsumexp(s.masked_fill(~mask[:, None, :], float("-inf")), -1).float()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES,
                         ids=lambda c: f"L{'-'.join(map(str, c[0]))}-H{c[1]}-D{c[2]}-Hi{c[3]}-B{c[4]}-lse{int(c[5])}"
                                       f"-sink{int(c[6])}")
def test_dense_loss_kernel_route_matches_reference(case, monkeypatch):
    lengths, h, dqk, hi, budget, with_lse, with_sink = case
    from dsa_plugins.kernels import indexer_loss

    monkeypatch.setattr(indexer_loss, "DENSE_CHUNK_BYTES", budget)
    seed = int.from_bytes(os.urandom(4), "little")
    iq, ik, w, q, kv = _inputs(lengths, h, dqk, hi, seed)
    t = iq.shape[0]
    start, end = _packed_causal_windows(lengths, "cuda")
    end = end.clone()
    end[2] = start[2]  # a row without a key
    g = torch.Generator().manual_seed(seed + 1)
    rw = torch.rand(t, generator=g).cuda()
    rw[3] = 0.0
    scale = dqk ** -0.5
    lse = _dense_attention_lse(q, kv, start, end, scale) if with_lse else None
    sink = (torch.randn(h, generator=g) + 2.0).cuda() if with_sink else None
    leaves = [x.clone().requires_grad_() for x in (iq, ik, w)]
    loss = ops.indexer_kl_loss(*leaves, q, kv, lse, scale, key_start=start, key_end=end, backend="tilelang",
                               row_weights=rw, sink=sink)
    ref_leaves = [x.detach().double().requires_grad_() for x in (iq, ik, w)]
    ref = indexer_kl_loss_reference(*ref_leaves, q.double(), kv.double(), None if lse is None else lse.double(),
                                    scale, key_start=start, key_end=end, row_weights=rw.double(),
                                    sink=None if sink is None else sink.double())
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item()) + 1e-5, (loss, ref, seed)
    got = torch.autograd.grad(loss, leaves)
    want = torch.autograd.grad(ref, ref_leaves)
    for name, a, b in zip(("d_index_q", "d_index_k", "d_weights"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a.float(), b) < 2e-2, (name, seed)
    assert got[0][2].abs().max() == 0 and got[2][2].abs().max() == 0  # the row without a key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dense_loss_is_bitwise_reproducible_and_keeps_nan(monkeypatch):
    from dsa_plugins.kernels import indexer_loss

    monkeypatch.setattr(indexer_loss, "DENSE_CHUNK_BYTES", 256 << 10)  # several chunks and key-block splits
    lengths = [700, 300]
    iq, ik, w, q, kv = _inputs(lengths, 64, 576, 32, 7)
    start, end = _packed_causal_windows(lengths, "cuda")
    scale = 576 ** -0.5

    def run(iq_in):
        leaves = [x.clone().requires_grad_() for x in (iq_in, ik, w)]
        loss = ops.indexer_kl_loss(*leaves, q, kv, None, scale, key_start=start, key_end=end, backend="tilelang")
        return (loss.detach(),) + torch.autograd.grad(loss, leaves)

    first = run(iq)
    for _ in range(4):
        again = run(iq)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    bad = iq.clone()
    bad[5, 3, 0] = float("nan")
    out = run(bad)
    assert torch.isnan(out[0])  # the row's logits are NaN: so is the loss
    assert torch.isnan(out[1][5]).any() and torch.isnan(out[2]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("h, dqk, given, with_sink", [(64, 576, True, False), (128, 512, True, True),
                                                      (16, 576, True, False), (32, 512, False, False),
                                                      (40, 576, False, True), (16, 576, False, True),
                                                      (64, 576, False, False),
                                                      (128, 576, False, True), (192, 512, False, False)])
def test_dense_target_tiles_match_float64(h, dqk, given, with_sink):
    """The tiled target alone, in the layout of the chunk's logits: inside each row's window it is the float64
    head sum of exp(scale <q, kv> - norm) (packed sequences, a partial last score block, an empty window),
    norm given or computed by the tiled normaliser (with a sink: logaddexp'ed with it); a NaN query makes its
    row NaN inside the window and leaves the other rows alone."""
    from dsa_plugins.kernels import indexer as K
    from dsa_plugins.kernels import indexer_loss

    lengths = [131, 2, 260]
    t = sum(lengths)
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, dqk, generator=g).cuda().bfloat16()
    kv = torch.randn(t, dqk, generator=g).cuda().bfloat16()
    start, end = _packed_causal_windows(lengths, "cuda")
    end = end.clone()
    end[7] = start[7]  # a row without a key
    scale = dqk ** -0.5
    lse = _dense_attention_lse(q, kv, start, end, scale)
    sink = (torch.randn(h, generator=g) + 3.0).cuda() if with_sink else None
    norm = lse.double() if sink is None else torch.logaddexp(lse.double(), sink.double()[None, :])
    lse[7] = 0.0  # (the row without a key: its normaliser is never used)
    plan = K._Plan(torch.zeros(t, 64, 128, device="cuda", dtype=torch.bfloat16),
                   torch.zeros(t, 128, device="cuda", dtype=torch.bfloat16), torch.zeros(t, 64, device="cuda"),
                   start.int(), end.int(), None, 1 << 40)
    (chunk,) = plan.chunks
    width = chunk[2] * plan.bk

    def target(q_in):
        return indexer_loss._dense_target(plan, chunk, q_in, kv, lse if given else None, sink, scale, width)

    got = target(q)
    keys = plan.base[:, None].long() + torch.arange(width, device="cuda")[None, :]
    inside = (torch.arange(width, device="cuda")[None, :] >= plan.ks[:, None]) & (
        torch.arange(width, device="cuda")[None, :] < plan.ke[:, None])
    s = torch.einsum("thd,tcd->thc", q.double(), kv.double()[keys.clamp(max=t - 1)]) * scale
    want = torch.exp(s - norm[:, :, None]).sum(1)
    assert inside.sum() == (end - start).clamp(min=0).sum()
    assert not torch.isnan(got[inside]).any()
    assert rel_err(got[inside], want[inside]) < 1e-2, seed
    bad = q.clone()
    bad[40, h - 1, 3] = float("nan")
    again = target(bad)
    assert torch.isnan(again[40][inside[40]]).all()
    others = inside.clone()
    others[40] = False
    assert torch.equal(again[others], got[others])
