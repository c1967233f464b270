"""GPU: the canonical top-k (lowest index wins among equal scores, -0.0 ties +0.0) in every kernel
path, rows that are the same alone and packed, and NaN that propagates while empty rows stay 0.

Exact set comparisons need scores that both the kernel and the torch reference compute exactly:
small integer inputs (integer products and sums well under 2**24 are exact in bf16 x bf16 -> fp32
whatever the summation order), so every tie the reference sees, the kernel sees too.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
tilelang = pytest.importorskip("tilelang")
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
    pytestmark.append(pytest.mark.skip(reason="TileLang kernels need Hopper"))

from dsa_plugins import ops  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402
from dsa_plugins.reference.indexer import indexer_topk_reference, topk_rows_reference  # noqa: E402
from tests.helpers import random_indices, rel_err  # noqa: E402

TOPK_CONFIGS = pytest.mark.parametrize(
    "cfg", TK.SHIPPED_CONFIGS, ids=lambda c: f"t{c['threads']}c{c['cap']}{'a' if c.get('agg') else ''}{'p%d' % c['parts'] if c.get('parts') else ''}"
)


def _sets(rows: torch.Tensor) -> torch.Tensor:
    """Each row's indices sorted, -1 first (the torch reference orders a row by score, the kernels by index)."""
    return rows.long().sort(dim=-1).values.cpu()


def _tie_rows(kind: str, R: int, N: int, gen) -> torch.Tensor:
    if kind == "zeros_mixed_sign":  # every score 0, half of them -0.0
        x = torch.zeros(R, N)
        x[torch.rand(R, N, generator=gen) < 0.5] = -0.0
        return x
    if kind == "few_values":  # 5 distinct values: ties across the k-th boundary
        return torch.randint(-2, 3, (R, N), generator=gen).float()
    if kind == "one_bucket":  # 3 values inside one 12-bit bucket: ties among the shared-memory candidates
        return 1.0 + torch.randint(0, 3, (R, N), generator=gen).float() * 2**-20
    if kind == "mostly_equal":  # a few larger values, then one value shared by everything else
        x = torch.ones(R, N)
        x[torch.rand(R, N, generator=gen) < 0.01] = 2.0
        return x
    raise ValueError(kind)


@TOPK_CONFIGS
@pytest.mark.parametrize("kind", ["zeros_mixed_sign", "few_values", "one_bucket", "mostly_equal"])
@pytest.mark.parametrize("N,k", [(1000, 1), (4099, 300), (10000, 2048), (32768, 2048), (40000, 7)])
def test_radix_topk_lowest_index_wins(cfg, kind, N, k):
    gen = torch.Generator().manual_seed(N * 7 + k)
    R = 6
    x = _tie_rows(kind, R, N, gen)
    lengths = torch.randint(k, N + 1, (R,), generator=gen).to(torch.int32)
    lengths[0] = N
    for lens in (None, lengths):
        out = TK.topk_rows(x.cuda(), None if lens is None else lens.cuda(), k, config=cfg)
        want = topk_rows_reference(x, lens, k)
        assert torch.equal(_sets(out), _sets(want)), f"{kind}: tie choice differs from the lowest-index rule"


@TOPK_CONFIGS
def test_radix_topk_window_starts_are_a_shift(cfg):
    """topk_rows_ranges over [start, end): the choice among ties is the same wherever the window sits."""
    gen = torch.Generator().manual_seed(5)
    N, k = 12000, 500
    x = torch.randint(0, 3, (4, N), generator=gen).float()
    for start in (0, 1, 3, 777):
        padded = torch.zeros(4, (N + start + 7) // 4 * 4)  # rows a multiple of 4 wide (the kernel's float4 loads)
        padded[:, start:start + N] = x
        starts = torch.full((4,), start, dtype=torch.int32)
        ends = starts + N
        out = TK.topk_rows_ranges(padded.cuda().contiguous(), starts.cuda(), ends.cuda(), k, config=cfg)
        want = topk_rows_reference(x, None, k) + start
        assert torch.equal(_sets(out), _sets(want)), start


def _integer_indexer_inputs(tq, tk, hi, di, gen, distinct_keys=5):
    """index_q in {-1, 0, 1}, index_k drawn from a few distinct integer rows, weights in {0.5, 1, 2}:
    exact scores, many exact ties."""
    q = torch.randint(-1, 2, (tq, hi, di), generator=gen).to(torch.bfloat16)
    pool = torch.randint(-1, 2, (distinct_keys, di), generator=gen).to(torch.bfloat16)
    k = pool[torch.randint(0, distinct_keys, (tk,), generator=gen)]
    w = 2.0 ** torch.randint(-1, 2, (tq, hi), generator=gen).float()
    return q, k, w


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("hi,di", [(64, 128), (32, 128), (16, 64)])
def test_indexer_ties_follow_the_rule_and_packing(hi, di, fp8):
    if fp8 and di % 32:
        pytest.skip("fp8 keys need Di % 32 == 0")
    gen = torch.Generator().manual_seed(hi + di + fp8)
    lens = [700, 1, 2500, 129, 3000]
    q, kk, w = _integer_indexer_inputs(sum(lens), sum(lens), hi, di, gen)
    starts = torch.tensor([0] + lens[:-1]).cumsum(0)
    ks = torch.cat([torch.full((n,), int(s)) for s, n in zip(starts, lens)]).to(torch.int32)
    ke = torch.cat([torch.arange(int(s) + 1, int(s) + n + 1) for s, n in zip(starts, lens)]).to(torch.int32)
    topk = 256
    scale = None
    if fp8:  # {-1, 0, 1} are exact in e4m3: unit key scales keep every score exact
        q8, k8 = q.float().to(torch.float8_e4m3fn), kk.float().to(torch.float8_e4m3fn)
        scale = torch.ones(kk.shape[0]).cuda()
        args = (q8.cuda(), k8.cuda(), w.cuda())
        ref_args = (q8.float(), k8.float(), w)
    else:
        args = (q.cuda(), kk.cuda(), w.cuda())
        ref_args = (q.float(), kk.float(), w)
    packed = ops.indexer_topk(*args, topk, ks.cuda(), ke.cuda(), backend="tilelang", index_k_scale=scale)
    want = indexer_topk_reference(*ref_args, topk, ks, ke, None if scale is None else scale.cpu())
    assert torch.equal(_sets(packed), _sets(want))
    # each sequence alone (its own keys, windows from 0): the same rows, shifted
    for s0, n in zip(starts.tolist(), lens):
        sl = slice(s0, s0 + n)
        alone = ops.indexer_topk(
            args[0][sl], args[1][sl], args[2][sl], topk, ks[sl].cuda() - s0, ke[sl].cuda() - s0,
            backend="tilelang", index_k_scale=None if scale is None else scale[sl])
        shifted = torch.where(alone >= 0, alone + s0, alone)
        assert torch.equal(shifted, packed[sl])  # the same set, in the same (ascending) order


def test_indexer_decode_split_ties_follow_the_rule(monkeypatch):
    """The generation-step grid (key ranges split over CTAs) keeps the rule."""
    from dsa_plugins.kernels import indexer as K

    gen = torch.Generator().manual_seed(11)
    lens = [3000, 5000, 1, 8191, 4096, 2500, 7000, 6000]
    B, Tk = len(lens), sum(lens)
    q, kk, w = _integer_indexer_inputs(B, Tk, 64, 128, gen, distinct_keys=3)
    starts = torch.tensor([0] + lens[:-1]).cumsum(0).to(torch.int32)
    ke = starts + torch.tensor(lens, dtype=torch.int32)
    assert K._splits(B, -(-Tk // 128), torch.device("cuda"), one_row_blocks=True) > 1
    out = K.indexer_topk(q.cuda(), kk.cuda(), w.cuda(), starts.cuda(), ke.cuda(), 2048)
    want = indexer_topk_reference(q.float(), kk.float(), w, 2048, starts, ke)
    assert torch.equal(_sets(out), _sets(want))


def test_indexer_rows_alone_and_packed_random_scores():
    """Random (non-integer) scores: a row's selection is bitwise the same set alone and packed."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    T_, hi, di = 3000, 64, 128
    q = torch.randn(T_, hi, di, device="cuda", generator=gen).bfloat16()
    k = torch.randn(T_, di, device="cuda", generator=gen).bfloat16()
    w = torch.randn(T_, hi, device="cuda", generator=gen) * 0.01
    ks, ke = ops.causal_key_windows(torch.tensor([0, T_], device="cuda"))
    full = ops.indexer_topk(q, k, w, 512, ks, ke, backend="tilelang")
    for rows in (slice(0, 1), slice(1234, 1300), slice(2999, 3000)):
        part = ops.indexer_topk(q[rows], k, w[rows], 512, ks[rows], ke[rows], backend="tilelang")
        assert torch.equal(part, full[rows])  # the same set, in the same (ascending) order


@pytest.mark.parametrize("context", [70000, 5000])
def test_generation_step_bitwise_alone_and_batched(context):
    """A generation step (indexer top-k, then the attention over its slots) gives a sequence the same bits
    alone and in a batch of 32, and again on a second run: the batch picks other top-k programs (a split
    row alone, two CTAs a row in the batch), whose slots come back in the same ascending order."""
    g = torch.Generator(device="cuda").manual_seed(context)
    B, hi, di, h, d, dv, k = 32, 32, 128, 64, 576, 512, 2048
    iq = torch.randn(B, 1, hi, di, device="cuda", generator=g).bfloat16()
    ik = torch.randn(B, context, di, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, 1, hi, device="cuda", generator=g) * 0.05
    q = torch.randn(B, 1, h, d, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, context, d, device="cuda", generator=g).bfloat16()
    ks = torch.zeros(B, 1, dtype=torch.int32, device="cuda")
    ke = torch.full((B, 1), context, dtype=torch.int32, device="cuda")

    def step(sl):
        rows = ops.indexer_topk(iq[sl], ik[sl], w[sl], k, ks[sl], ke[sl], backend="tilelang")
        return rows, ops.sparse_attention(q[sl], kv[sl], rows, 0.04, dv=dv, backend="tilelang")

    rows, out = step(slice(0, B))
    for sl in (slice(0, 1), slice(7, 8), slice(0, B)):
        alone_rows, alone_out = step(sl)
        assert torch.equal(alone_rows, rows[sl]), f"indices of rows {sl}"
        assert torch.equal(alone_out, out[sl]), f"attention of rows {sl}"


# ---------------------------------------------------------------- attention rows and NaN
def _same_nan_and_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 3e-2):
    """NaN in the same places (per row of the last dim for gradients, where the summation order of
    bf16 and fp64 may move a NaN between columns), inf in the same places, and the finite rest
    within ``tol`` in norm-relative error."""
    g, w = got.double().cpu(), want.double().cpu()
    gn, wn = torch.isnan(g), torch.isnan(w)
    if g.dim() >= 2 and what.split(": ")[-1].startswith("d"):
        gn, wn = gn.any(-1), wn.any(-1)
        fin = ~(torch.isnan(g).any(-1) | torch.isnan(w).any(-1))
        g, w = g[fin], w[fin]
    else:
        fin = ~(gn | wn)
        assert torch.equal(torch.isinf(g[fin]), torch.isinf(w[fin])), f"{what}: inf in different places"
        fin &= torch.isfinite(w)
        g, w = g[fin], w[fin]
    assert torch.equal(gn, wn), f"{what}: NaN in different places"
    assert not bool(torch.isnan(g).any() | torch.isnan(w).any())
    assert rel_err(g, w) < tol, f"{what}: rel err {rel_err(g, w):.3g}"


def _attention_case(h, dqk, dv, sink, seed):
    gen = torch.Generator().manual_seed(seed)
    b, s, skv, k = 1, 40, 300, 70
    q = torch.randn(b, s, h, dqk, generator=gen)
    kv = torch.randn(b, skv, dqk, generator=gen)
    idx = random_indices(b, s, k, skv, generator=gen, empty_rows=3)
    z = torch.randn(h, generator=gen) if sink else None
    return q, kv, idx, z


@pytest.mark.parametrize("h,dqk,dv,sink", [(64, 576, 512, False), (128, 512, 512, True), (16, 576, 512, False)])
@pytest.mark.parametrize("where", ["q", "kv_selected", "kv_unselected", "sink", "dout", "none"])
def test_attention_nan_propagates_and_empty_rows_stay_zero(h, dqk, dv, sink, where):
    """Kernel and reference agree on where NaN lands (forward and backward); empty rows: out 0,
    lse +inf, zero gradients, whatever else carries NaN."""
    if where == "sink" and not sink:
        pytest.skip("no sink")
    q, kv, idx, z = _attention_case(h, dqk, dv, sink, seed=h + dqk)
    empty = ((idx < 0) | (idx >= kv.shape[1])).all(-1)  # [b, s]
    dout = torch.randn(*q.shape[:-1], dv)
    if where == "q":
        q[0, 5, 3, 7] = float("nan")
        q[0, int(empty[0].nonzero()[0]), 1, 0] = float("nan")  # in an empty row: reaches nothing
    elif where == "kv_selected":
        row = int((~empty[0]).nonzero()[0])
        ok = (idx[0, row] >= 0) & (idx[0, row] < kv.shape[1])
        kv[0, int(idx[0, row][ok][0])] = float("nan")
    elif where == "kv_unselected":
        used = set(idx[(idx >= 0) & (idx < kv.shape[1])].tolist())
        kv[0, next(r for r in range(kv.shape[1]) if r not in used)] = float("nan")
    elif where == "sink":
        z[2] = float("nan")
    elif where == "dout":
        dout[0, 6, 4, 0] = float("nan")
        dout[0, int(empty[0].nonzero()[0]), 0, 0] = float("nan")
    results = {}
    for backend, dev, dt in (("tilelang", "cuda", torch.bfloat16), ("torch", "cpu", torch.float64)):
        leaves = [t.to(dev, dt).requires_grad_() for t in (q, kv)]
        zz = None if z is None else z.to(dev, torch.float32 if dt != torch.float64 else dt).requires_grad_()
        out, lse = ops.sparse_attention(leaves[0], leaves[1], idx.to(dev), 0.05, sink=zz, dv=dv, backend=backend,
                                        return_lse=True)
        grads = torch.autograd.grad(out, leaves + ([zz] if zz is not None else []), dout.to(dev, dt))
        results[backend] = (out, lse, *grads)
    names = ("out", "lse", "dq", "dkv", "dsink")
    for name, got, want in zip(names, results["tilelang"], results["torch"]):
        _same_nan_and_close(got, want, f"{where}: {name}")
    out, lse, dq = results["tilelang"][:3]
    e = empty.cuda()
    assert bool((out[e] == 0).all()) and bool(torch.isinf(lse[e]).all()) and bool((dq[e] == 0).all())
    if where != "none":
        assert any(bool(torch.isnan(t).any()) for t in results["tilelang"]) == (where != "kv_unselected")


def test_attention_rows_bitwise_alone_and_packed():
    """A query row's output and lse are bitwise the same alone and packed among other sequences."""
    gen = torch.Generator().manual_seed(9)
    lens = [50, 3, 200]
    T_, h, d, k = sum(lens), 64, 576, 64
    q = torch.randn(T_, h, d, generator=gen).cuda().bfloat16()
    kv = torch.randn(T_, d, generator=gen).cuda().bfloat16()
    off = 0
    idx = []
    for n in lens:  # causal rows of each sequence, global rows
        for t in range(n):
            r = torch.randint(0, t + 1, (k,), generator=gen) + off
            r[torch.rand(k, generator=gen) < 0.2] = -1
            idx.append(r)
        off += n
    idx = torch.stack(idx).to(torch.int32).cuda()
    out, lse = ops.sparse_attention(q, kv, idx, 0.05, dv=512, backend="tilelang", return_lse=True)
    off = 0
    for n in lens:
        sl = slice(off, off + n)
        local = torch.where(idx[sl] >= 0, idx[sl] - off, idx[sl])
        o, l_ = ops.sparse_attention(q[sl], kv[sl], local, 0.05, dv=512, backend="tilelang", return_lse=True)
        assert torch.equal(o, out[sl]) and torch.equal(l_, lse[sl])
        off += n


@pytest.mark.parametrize("where", ["attn_q", "index_q", "index_q_empty_row", "none"])
def test_indexer_loss_nan_like_the_reference(where):
    gen = torch.Generator().manual_seed(21)
    t, h, dqk, hi, di, k = 200, 64, 576, 64, 128, 64
    q = torch.randn(t, h, dqk, generator=gen)
    kv = torch.randn(t, dqk, generator=gen)
    iq = torch.randn(t, hi, di, generator=gen)
    ik = torch.randn(t, di, generator=gen)
    w = torch.rand(t, hi, generator=gen) * 0.02
    idx = random_indices(1, t, k, t, generator=gen, out_of_range=False, dup_frac=0, empty_rows=2)[0]
    empty = (idx < 0).all(-1)
    if where == "attn_q":
        q[7, 0, 0] = float("nan")
    elif where == "index_q":
        iq[9, 3, 5] = float("nan")
    elif where == "index_q_empty_row":
        iq[int(empty.nonzero()[0]), 0, 0] = float("nan")
    results = {}
    for backend, dev, dt in (("tilelang", "cuda", torch.bfloat16), ("torch", "cpu", torch.float64)):
        leaves = [x.to(dev, dt if x is not w else (torch.float32 if dt != torch.float64 else dt)).requires_grad_()
                  for x in (iq, ik, w)]
        loss = ops.indexer_kl_loss(*leaves, q.to(dev, dt), kv.to(dev, dt), None, 0.04, topk_indices=idx.to(dev),
                                   backend=backend)
        loss.backward()
        results[backend] = [loss.detach()] + [x.grad for x in leaves]
    for name, got, want in zip(("loss", "d_index_q", "d_index_k", "d_weights"), results["tilelang"],
                               results["torch"]):
        _same_nan_and_close(got, want, f"{where}: {name}")
    assert bool(torch.isnan(results["tilelang"][0])) == (where in ("attn_q", "index_q"))
