"""GPU tests of the TileLang indexer top-k and radix top-k (need a Hopper GPU and TileLang).

References are written here in float64 torch. Top-k results are compared as sets: a kernel
row is accepted when it has the right number of distinct valid indices, all inside the
window, and every selected key scores at least the reference k-th largest score minus a
small tolerance (fp32 accumulation vs float64); the exact set match rate is also checked.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

tilelang = pytest.importorskip("tilelang")


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


if torch.cuda.is_available() and not _hopper():
    pytestmark.append(pytest.mark.skip(reason="TileLang kernels need Hopper"))

from dsa_plugins.kernels import indexer as K  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402
from dsa_plugins.reference.indexer import topk_rows_reference  # noqa: E402
from tests.helpers import misaligned_view  # noqa: E402


# ---------------------------------------------------------------- references
def ref_scores(index_q, index_k, weights, rows, key_lo, key_hi):
    """float64 scores [len(rows), key_hi-key_lo] for query rows `rows` and keys [key_lo, key_hi)."""
    q = index_q[rows].double()
    k = index_k[key_lo:key_hi].double()
    w = weights[rows].double()
    s = torch.zeros(q.shape[0], k.shape[0], dtype=torch.float64, device=q.device)
    for h in range(q.shape[1]):
        s += (q[:, h] @ k.T).relu() * w[:, h : h + 1]
    return s


def check_indexer_rows(out, index_q, index_k, weights, ks, ke, topk, rel_tol=2e-5, block=1024):
    """Checks every row of `out` against float64 scores; returns the exact-set match rate."""
    tq = out.shape[0]
    exact = 0
    ks_l, ke_l = ks.tolist(), ke.tolist()
    for r0 in range(0, tq, block):
        r1 = min(tq, r0 + block)
        lo = max(0, min(ks_l[r0:r1]))
        hi = max(lo, max(ke_l[r0:r1]))
        s = ref_scores(index_q, index_k, weights, torch.arange(r0, r1, device=out.device), lo, hi)
        cols = torch.arange(lo, hi, device=out.device)
        mask = (cols[None] >= ks[r0:r1, None]) & (cols[None] < ke[r0:r1, None])
        s = s.masked_fill(~mask, float("-inf"))
        n = (ke[r0:r1] - ks[r0:r1]).clamp(min=0)
        o = out[r0:r1].long()
        kk = torch.clamp(n, max=topk)
        slot = torch.arange(topk, device=out.device)[None]
        valid = o >= 0
        # as many valid slots as min(window, topk); the rest -1 (order inside a row unspecified)
        assert torch.equal(valid.sum(1), kk), "wrong number of valid slots"
        assert bool(((o >= ks[r0:r1, None]) | ~valid).all()), "index before the window"
        assert bool(((o < ke[r0:r1, None]) | ~valid).all()), "index after the window"
        srt = torch.sort(torch.where(valid, o, -1 - slot), dim=1).values
        assert bool((srt[:, 1:] != srt[:, :-1]).all()), "duplicate indices"
        if hi > lo:
            ref_v, ref_i = torch.topk(s, min(topk, hi - lo), dim=1)
            kth = ref_v.gather(1, (kk - 1).clamp(min=0)[:, None]).squeeze(1)
            got = s.gather(1, (o - lo).clamp(min=0, max=max(hi - lo - 1, 0)))
            got = torch.where(valid, got, torch.full_like(got, float("inf")))
            scale = s.masked_fill(~mask, 0).abs().amax(1).clamp(min=1e-6)
            ok = got >= (kth - rel_tol * scale)[:, None]
            bad = (~ok).any(1) & (kk > 0)
            assert not bool(bad.any()), f"{int(bad.sum())} rows select keys below the k-th score"
            ref_i = torch.where(ref_v.isfinite(), ref_i + lo, torch.full_like(ref_i, -1))
            for r in range(r1 - r0):
                a = set(o[r][o[r] >= 0].tolist())
                b = set(ref_i[r][: int(kk[r])].tolist())
                exact += a == b
        else:
            exact += r1 - r0
    return exact / max(tq, 1)


def make_inputs(tq, tk, hi, di, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tq, hi, di, device="cuda", generator=g).bfloat16()
    k = torch.randn(tk, di, device="cuda", generator=g).bfloat16()
    w = torch.randn(tq, hi, device="cuda", generator=g) * (hi**-0.5 * di**-0.5)
    return q, k, w


def causal_windows(seqlens, device="cuda"):
    ks, ke = [], []
    off = 0
    for n in seqlens:
        for t in range(n):
            ks.append(off)
            ke.append(off + t + 1)
        off += n
    return torch.tensor(ks, dtype=torch.int32, device=device), torch.tensor(ke, dtype=torch.int32, device=device)


# ---------------------------------------------------------------- radix top-k
TOPK_CONFIGS = pytest.mark.parametrize(
    "cfg", [c for c in TK.SHIPPED_CONFIGS if not c.get("lse")],
    ids=lambda c: f"t{c['threads']}c{c['cap']}{'a' if c.get('agg') else ''}{'p%d' % c['parts'] if c.get('parts') else ''}"
)


@pytest.mark.parametrize("cfg", [c for c in TK.SHIPPED_CONFIGS if c.get("lse")],
                         ids=lambda c: f"t{c['threads']}c{c['cap']}{'a' if c.get('agg') else ''}{'p%d' % c['parts'] if c.get('parts') else ''}")
@pytest.mark.parametrize("kind", ["random", "clustered", "ties", "few_distinct"])
def test_topk_rows_lse(kind, cfg):
    """lse: each row's logsumexp over the scores it selected (float64 from the returned columns), through
    every path of the select program: ranges of at most k columns (all taken) and empty ranges, the
    shared-memory candidates, the global-memory refinement (clustered values overflow the candidates),
    threshold ties all taken, and more ties than still needed (the tie-fill program's rows, counted)."""
    g = torch.Generator(device="cuda").manual_seed(len(kind))
    R, N, k = 12, 16384, 700  # past the 1024-thread configurations' 8192 candidates: "clustered" re-reads the row
    if kind == "random":
        x = torch.randn(R, N, device="cuda", generator=g) * 4
    elif kind == "clustered":
        base = torch.arange(N, device="cuda", dtype=torch.int32) + (127 << 23)
        x = torch.stack([base[torch.randperm(N, device="cuda", generator=g)] for _ in range(R)]).view(torch.float32)
    elif kind == "ties":
        x = torch.randint(0, 5, (R, N), device="cuda", generator=g).float()
    else:
        x = 1.0 + torch.randint(0, 3, (R, N), device="cuda", generator=g).float() * 2**-20
    starts = torch.zeros(R, dtype=torch.int32, device="cuda")
    ends = torch.full((R,), N, dtype=torch.int32, device="cuda")
    starts[1], ends[1] = 100, 100 + k // 2  # fewer columns than k
    starts[2], ends[2] = 50, 50  # empty
    starts[3], ends[3] = 8, 8 + k  # exactly k
    lse = torch.empty(R, device="cuda")
    out = TK.topk_rows_ranges(x, starts, ends, k, config=cfg, lse=lse)
    plain = TK.topk_rows_ranges(x, starts, ends, k, config={**cfg, "lse": False})
    assert torch.equal(out.sort(1).values, plain.sort(1).values)
    picked = x.double().gather(1, out.long().clamp(min=0)).masked_fill(out < 0, float("-inf"))
    want = torch.logsumexp(picked, 1)
    assert lse[2] == float("-inf") and torch.isfinite(lse[[0, 1, 3] + list(range(4, R))]).all()
    keep = torch.isfinite(want)
    err = (lse[keep].double() - want[keep]).abs().max().item()
    assert err <= 2e-6 * max(1.0, want[keep].abs().max().item()), f"{kind}: lse max abs err {err:.3e}"
    if kind == "random":  # a NaN score is selected (it orders above every number) and makes its row's lse NaN
        x[0, 5] = float("nan")
        TK.topk_rows_ranges(x, starts, ends, k, config=cfg, lse=lse)
        assert bool(lse[0].isnan()) and bool(torch.isfinite(lse[4:]).all())


@pytest.mark.parametrize("cfg", [c for c in TK.SHIPPED_CONFIGS if c.get("lse")],
                         ids=lambda c: f"t{c['threads']}c{c['cap']}{'a' if c.get('agg') else ''}")
@pytest.mark.parametrize("N", [9000, 40000, 140000])
def test_topk_rows_lse_is_the_same_bits_every_run(N, cfg):
    """The lse of a row is summed in an order fixed by its columns, never by the order in which the candidates of
    the threshold digit were gathered (shared atomics): four runs give the same bits. N: rows within every
    configuration's bitmap, past the 256-thread one's (32K columns: the candidates walked a window of the bitmap at
    a time, 2 windows), past the 512-thread one's (64K: 3 windows at 140000) and the 1024-thread one's (128K)."""
    g = torch.Generator(device="cuda").manual_seed(N)
    R, k = 24, 2048
    x = torch.randn(R, N, device="cuda", generator=g) * 4  # some hundreds of candidates in the threshold digit
    starts = torch.zeros(R, dtype=torch.int32, device="cuda")
    ends = torch.full((R,), N, dtype=torch.int32, device="cuda")
    runs = []
    for _ in range(4):
        lse = torch.empty(R, device="cuda")
        out = TK.topk_rows_ranges(x, starts, ends, k, config=cfg, lse=lse)
        runs.append((out, lse))
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0])
        assert torch.equal(lse.view(torch.int32), runs[0][1].view(torch.int32)), (lse - runs[0][1]).abs().max()
    out, lse = runs[0]
    want = torch.logsumexp(x.double().gather(1, out.long()), 1)
    err = (lse.double() - want).abs().max().item()
    assert err <= 2e-6 * max(1.0, want.abs().max().item()), f"lse max abs err {err:.3e}"


@TOPK_CONFIGS
@pytest.mark.parametrize(
    "R,N,k",
    [(64, 32768, 2048), (7, 1000, 1), (5, 4099, 4096), (33, 777, 100), (3, 65536, 2048), (16, 5000, 6000),
     (300, 8192, 2048)],
)
def test_topk_rows_random(R, N, k, cfg):
    torch.manual_seed(R * N + k)
    x = torch.randn(R, N, device="cuda")
    lengths = torch.randint(0, N + 1, (R,), device="cuda", dtype=torch.int32)
    lengths[0] = N
    lengths[-1] = min(k, N) // 2
    for lens in (None, lengths):
        out = TK.topk_rows(x, lens, k, config=cfg)
        _check_topk(x, lens, k, out)


@TOPK_CONFIGS
def test_topk_rows_clustered_fallback(cfg):
    # All values share one 12-bit bucket (same exponent): the candidate set overflows the
    # shared-memory buffer and the kernel takes the global-memory refinement path.
    R, N, k = 8, 32768, 2048
    base = torch.arange(N, device="cuda", dtype=torch.int32) + (127 << 23)
    rows = torch.stack([base[torch.randperm(N, device="cuda")] for _ in range(R)])
    x = rows.view(torch.float32)  # distinct values in [1, 1.004)
    out = TK.topk_rows(x, None, k, config=cfg)
    _check_topk(x, None, k, out)
    x2 = -x  # negative values
    _check_topk(x2, None, k, TK.topk_rows(x2, None, k, config=cfg))


@TOPK_CONFIGS
def test_topk_rows_ties(cfg):
    R, N, k = 4, 10000, 300
    x = torch.randint(0, 5, (R, N), device="cuda").float()
    out = TK.topk_rows(x, None, k, config=cfg)
    _check_topk(x, None, k, out)
    # ties in the smem-candidate path: few distinct values inside one 12-bit bucket
    x = (1.0 + torch.randint(0, 3, (R, N), device="cuda").float() * 2**-20)
    _check_topk(x, None, k, TK.topk_rows(x, None, k, config=cfg))


@TOPK_CONFIGS
@pytest.mark.parametrize("background", ["far", "same_digit"])
@pytest.mark.parametrize("extra,dup", [(0, False), (3, False), (3, True)], ids=["exact", "more", "more_ties"])
def test_topk_rows_threshold_group_of_22_bits(extra, dup, background, cfg):
    """The columns left to select after the second digit share a 22-bit key prefix: when there are exactly as many
    as still needed, the select programs skip the third digit and take them all; with more, the third digit (and
    the finish program for equal keys) picks among them. Either way the canonical set, in ascending order.
    ``same_digit``: every other column shares the group's first digit (a lower second one), more than any
    program's candidate buffer holds, so the later digits re-read the row from global memory."""
    g = torch.Generator(device="cuda").manual_seed(extra + 10 * dup + cfg["threads"] + cfg.get("parts", 0))
    R, N, k, need = 4, 40000, 300, 5
    if background == "far":
        x = torch.rand(R, N, device="cuda", generator=g)  # far below the threshold
    else:  # 3.0 + up to 0xFFBFF ulps: the group's 12-bit digit, a second digit below its 0x3FF
        x = (torch.randint(0, 0xFFC00, (R, N), device="cuda", generator=g, dtype=torch.int32) | 0x40400000).view(
            torch.float32)
    for r in range(R):
        cols = torch.randperm(N, device="cuda", generator=g)[: k + extra]
        x[r, cols[: k - need]] = 1000.0 + torch.arange(k - need, device="cuda", dtype=torch.float32)
        low = torch.randperm(1024, device="cuda", generator=g)[: need + extra].int()
        if dup:  # the need-th largest key three times: the lowest of its columns is taken
            low = torch.tensor([1023, 1022, 1021, 1020, 500, 500, 500, 100], device="cuda", dtype=torch.int32)
        group = (torch.full_like(low, 0x404FFC00) | low).view(torch.float32)  # 3.0 with its 20 low bits set
        x[r, cols[k - need:]] = group
    got = TK.topk_rows_ranges(x, torch.zeros(R, dtype=torch.int32, device="cuda"),
                              torch.full((R,), N, dtype=torch.int32, device="cuda"), k, config=cfg)
    assert torch.equal(got, topk_rows_reference(x, None, k).sort(dim=1).values)  # the canonical set, ascending


@pytest.mark.parametrize("split", [TK.SPLIT_CONFIG, TK.SPLIT4_CONFIG, TK.SPLIT2_CONFIG], ids=lambda c: f"p{c['parts']}")
@pytest.mark.parametrize("kind", ["random", "clustered", "few_values", "mostly_equal", "zeros_mixed_sign"])
def test_split_topk_matches_one_cta_per_row(kind, split):
    """The split program (a row over a cluster of CTAs) selects the same sets as one CTA per row: ranges not
    aligned to 4 columns, per-row offsets, a range of fewer than k columns and an empty one, ties at the threshold
    (all needed, or more than needed: the tie-fill's rows), and a row whose threshold digit holds more columns than
    a CTA's candidate buffer (the refinement re-reads the slice)."""
    g = torch.Generator(device="cuda").manual_seed(len(kind))
    R, N, k = 6, 70000, 2048
    if kind == "random":
        x = torch.randn(R, N, device="cuda", generator=g)
    elif kind == "clustered":  # one 12-bit bucket: 8750 (17500) columns per CTA, over its 4096 candidates
        base = torch.arange(N, device="cuda", dtype=torch.int32) + (127 << 23)
        x = torch.stack([base[torch.randperm(N, device="cuda", generator=g)] for _ in range(R)]).view(torch.float32)
    elif kind == "few_values":
        x = torch.randint(-2, 3, (R, N), device="cuda", generator=g).float()
    elif kind == "mostly_equal":
        x = torch.ones(R, N, device="cuda")
        x[torch.rand(R, N, device="cuda", generator=g) < 0.01] = 2.0
    else:
        x = torch.zeros(R, N, device="cuda")
        x[torch.rand(R, N, device="cuda", generator=g) < 0.5] = -0.0
    starts = torch.tensor([0, 3, 1001, 5, 0, 17], dtype=torch.int32, device="cuda")
    ends = torch.tensor([N, N - 1, 1001 + k - 1, 5, 65537, 40003], dtype=torch.int32, device="cuda")
    offsets = torch.randint(0, 1000, (R,), dtype=torch.int32, device="cuda", generator=g)
    got = TK.topk_rows_ranges(x, starts, ends, k, row_offsets=offsets, config=split)
    ref = TK.topk_rows_ranges(x, starts, ends, k, row_offsets=offsets, config=TK.DEFAULT_CONFIG)
    assert torch.equal(got, ref)  # the same sets in the same (ascending) order
    assert_ascending_then_padding(got)
    assert TK.config_for_rows(R, N) == TK.SPLIT_CONFIG and not TK.config_for_rows(R, N, lse=True).get("parts")


@pytest.mark.parametrize("N", [70000, 9000, 300000])
def test_topk_rows_bitwise_alone_and_batched(N):
    """A row's output is bit for bit the same alone (split program at 64K+ columns), among 32 rows (two-CTA
    split), among 300 (256- or 512-thread CTAs) and from run to run: the entries come in ascending order, so
    the attention that sums them in slot order gives the same bits however the rows were batched."""
    g = torch.Generator(device="cuda").manual_seed(N)
    x = torch.randn(300, N, device="cuda", generator=g)
    x[5] = torch.randint(-2, 3, (N,), device="cuda", generator=g).float()  # more threshold ties than needed
    k = 2048
    configs = {TK.config_for_rows(r, N)["threads"] * 10 + TK.config_for_rows(r, N).get("parts", 0)
               for r in (1, 32, 300)}
    assert len(configs) >= 2, "the row counts must pick different programs"
    many = TK.topk_rows(x, None, k)
    assert_ascending_then_padding(many)
    for rows in (slice(0, 1), slice(5, 6), slice(0, 32), slice(0, 300)):
        for _ in range(3):
            assert torch.equal(TK.topk_rows(x[rows].contiguous(), None, k), many[rows])


def test_topk_rows_k_above_the_finish_programs_buffer():
    """k > SORT_MAX_K: the rows are ordered by the wrapper, the same order."""
    g = torch.Generator(device="cuda").manual_seed(5)
    k = TK.SORT_MAX_K + 100
    x = torch.randn(3, k + 5000, device="cuda", generator=g)
    lens = torch.tensor([k + 5000, k - 7, k + 1], dtype=torch.int32, device="cuda")
    _check_topk(x, lens, k, TK.topk_rows(x, lens, k))


def assert_ascending_then_padding(out):
    """Each row: its valid indices strictly ascending, then only -1 (the finish program's canonical order)."""
    valid = out >= 0
    n = valid.sum(1, keepdim=True)
    slot = torch.arange(out.shape[1], device=out.device)[None]
    assert torch.equal(valid, slot < n), "-1 padding must come last"
    step = out[:, 1:].long() - out[:, :-1].long()
    assert bool(((step > 0) | ~valid[:, 1:]).all()), "valid indices must be strictly ascending"


def _check_topk(x, lens, k, out):
    assert_ascending_then_padding(out)
    R, N = x.shape
    n = torch.full((R,), N, device="cuda") if lens is None else lens.long()
    kk = n.clamp(max=k)
    valid = out >= 0
    assert out.shape == (R, k) and out.dtype == torch.int32
    assert torch.equal(valid.sum(1), kk)
    assert bool(((out < n[:, None]) | ~valid).all())
    for r in range(R):
        sel = out[r][valid[r]].long()
        assert sel.unique().numel() == sel.numel(), "duplicates"
        m = int(n[r])
        if m == 0:
            continue
        ref = torch.topk(x[r, :m], min(k, m)).values
        got = torch.sort(x[r, sel], descending=True).values
        assert torch.equal(got, ref), f"row {r}: selected values differ from torch.topk"


# ---------------------------------------------------------------- indexer
@pytest.mark.parametrize("hi,di", [(64, 128), (32, 128), (16, 64)])
def test_indexer_causal_single(hi, di):
    T, k = 1000, 256  # T not a multiple of the blocks; early rows have < k keys
    q, kk, w = make_inputs(T, T, hi, di, seed=hi)
    ks, ke = causal_windows([T])
    out = K.indexer_topk(q, kk, w, ks, ke, k)
    rate = check_indexer_rows(out, q, kk, w, ks, ke, k)
    assert rate > 0.98


def test_misaligned_views_give_the_aligned_results():
    """Contiguous views whose base is off a 16-byte boundary: the wrappers copy them (the programs read by TMA and
    vector loads) rather than fault with a misaligned address; the same rows as the aligned inputs."""
    T, k = 300, 64
    q, kk, w = make_inputs(T, T, 32, 128, seed=5)
    ks, ke = causal_windows([T])
    ref = K.indexer_topk(q, kk, w, ks, ke, k)
    got = K.indexer_topk(misaligned_view(q), misaligned_view(kk), misaligned_view(w), ks, ke, k)
    assert torch.equal(got.sort(1).values, ref.sort(1).values)
    x = torch.randn(7, 1000, device="cuda")
    assert torch.equal(TK.topk_rows(misaligned_view(x), None, 100).sort(1).values,
                       TK.topk_rows(x, None, 100).sort(1).values)


def test_indexer_varlen_many_short_some_long():
    g = torch.Generator().manual_seed(1)
    seqlens = torch.randint(1, 200, (40,), generator=g).tolist() + [3000, 1, 2500, 7]
    T = sum(seqlens)
    q, kk, w = make_inputs(T, T, 64, 128, seed=2)
    ks, ke = causal_windows(seqlens)
    for k in (1, 64, 2048):
        out = K.indexer_topk(q, kk, w, ks, ke, k)
        assert check_indexer_rows(out, q, kk, w, ks, ke, k) > 0.98


def test_indexer_cp_shard_arbitrary_windows():
    Tk = 6000
    rows = 700
    q, kk, w = make_inputs(rows, Tk, 64, 128, seed=3)
    g = torch.Generator(device="cuda").manual_seed(4)
    a = torch.randint(0, Tk, (rows,), device="cuda", generator=g)
    b = torch.randint(0, Tk + 1, (rows,), device="cuda", generator=g)
    ks = torch.minimum(a, b).int()
    ke = torch.maximum(a, b).int()
    ke[:5] = ks[:5]  # empty windows
    ks[5:10], ke[5:10] = 0, Tk  # full
    out = K.indexer_topk(q, kk, w, ks, ke, 512)
    assert check_indexer_rows(out, q, kk, w, ks, ke, 512) > 0.98
    assert bool((out[:5] == -1).all())
    # small chunk budget: many chunks, same answer as sets
    out2 = K.indexer_topk(q, kk, w, ks, ke, 512, max_chunk_bytes=1 << 20)
    assert check_indexer_rows(out2, q, kk, w, ks, ke, 512) > 0.98


@TOPK_CONFIGS
def test_indexer_topk_configs(cfg):
    T, k = 3000, 700
    q, kk, w = make_inputs(T, T, 64, 128, seed=11)
    ks, ke = causal_windows([T])
    out = K.indexer_topk(q, kk, w, ks, ke, k, topk_config=cfg)
    assert check_indexer_rows(out, q, kk, w, ks, ke, k) > 0.98


def test_indexer_k_larger_than_sequence():
    T = 300
    q, kk, w = make_inputs(T, T, 64, 128, seed=5)
    ks, ke = causal_windows([T])
    out = K.indexer_topk(q, kk, w, ks, ke, 4096)
    check_indexer_rows(out, q, kk, w, ks, ke, 4096)
    # windows of at most k keys: all of them, then -1
    assert torch.equal(out[:, 300:], torch.full_like(out[:, 300:], -1))


@pytest.mark.parametrize("k,block_q", [(2048, 4), (700, 4), (2048, 1)])
def test_indexer_whole_windows_are_not_scored(k, block_q):
    """Rows whose window holds at most k keys select all of it without their scores: a query block of only such
    rows is not scored (its buffer rows stay as they were), and the result is bit for bit the call that scores
    every block (sequences shorter and longer than k, k not a multiple of a block, an empty window)."""
    seqlens = [5, 700, 1500, k, k + 1, 3001, 1, 2 * k + 37]
    T = sum(seqlens)
    cfg = K.default_config(64, 128, rows=None if block_q == 4 else 1)  # the prefill / generation-step programs
    assert cfg["block_q"] == block_q
    q, kk, w = make_inputs(T, T, 64, 128, seed=k + block_q)
    ks, ke = causal_windows(seqlens)
    ke[3] = ks[3]  # an empty window
    out = K.indexer_topk(q, kk, w, ks, ke, k, config=cfg)
    assert torch.equal(out, K.indexer_topk(q, kk, w, ks, ke, k, config=cfg, score_whole_windows=True))
    assert check_indexer_rows(out, q, kk, w, ks, ke, k) > 0.98
    # the blocks left out are those, and only those, whose rows all hold at most k keys
    plan = K._Plan(q, kk, w, ks, ke, cfg, 1 << 62, select_all_max=k)
    longest = (ke - ks).clamp(min=0).long()
    longest = torch.nn.functional.pad(longest, (0, -T % plan.bq)).view(-1, plan.bq).amax(1)
    skipped = longest <= k
    assert 0 < int(skipped.sum()) < skipped.numel()
    assert torch.equal(plan.blk_hi_scored, torch.where(skipped, plan.blk_lo, plan.blk_hi))
    (chunk,) = plan.chunks
    buf = torch.full((T, chunk[2] * plan.bk), float("nan"), device="cuda")
    plan.chunk_scores(chunk, scores=buf)
    written = ~buf.isnan().all(1)
    row_skipped = skipped.repeat_interleave(plan.bq)[:T]
    assert not bool(written[row_skipped].any()), "a block of whole windows was scored"
    assert bool(written[~row_skipped & (ke > ks)].all())
    # a call in which no block needs scores, and a generation step over caches of <= k and > k keys
    short = K.indexer_topk(q[:600], kk, w[:600], ks[:600].clamp(max=0), ke[:600].clamp(max=k), k, config=cfg)
    want = torch.arange(k, device="cuda", dtype=torch.int32).expand(600, k)
    n = ke[:600].clamp(max=k).long()
    assert torch.equal(short, torch.where(torch.arange(k, device="cuda")[None] < n[:, None], want, -1))
    B, tk = 4, 3 * k
    qd, kd, wd = make_inputs(B, B * tk, 64, 128, seed=3)
    lens = torch.tensor([17, k, k + 1, tk], dtype=torch.int32, device="cuda")
    zero = torch.zeros_like(lens)
    step = K.indexer_topk(qd, kd, wd, zero, lens, k, entries=(1, tk), entry_windows=True)
    again = K.indexer_topk(qd, kd, wd, zero, lens, k, entries=(1, tk), entry_windows=True, score_whole_windows=True)
    assert torch.equal(step, again)


@pytest.mark.parametrize("k", [2048, 4096])
def test_indexer_causal_8k(k):
    T = 8192
    q, kk, w = make_inputs(T, T, 64, 128, seed=k)
    ks, ke = causal_windows([T])
    out = K.indexer_topk(q, kk, w, ks, ke, k)
    rows = torch.cat([torch.arange(0, 64), torch.arange(T - 2048, T)]).cuda()
    sub = check_indexer_rows(out[rows], q[rows], kk, w[rows], ks[rows], ke[rows], k)
    assert sub > 0.95


def test_indexer_peak_memory_64k():
    T, k = 65536, 2048
    q, kk, w = make_inputs(T, T, 64, 128, seed=7)
    ar = torch.arange(T, device="cuda", dtype=torch.int32)
    ks, ke = torch.zeros_like(ar), ar + 1
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = K.indexer_topk(q, kk, w, ks, ke, k)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 * 2**30, f"peak {peak / 2**30:.2f} GiB"  # [T, T] fp32 would be 16 GiB
    rows = torch.tensor([0, 1, 2047, 2048, 40000, T - 1], device="cuda")
    assert check_indexer_rows(out[rows], q[rows], kk, w[rows], ks[rows], ke[rows], k) > 0.8


# ---------------------------------------------------------------- fp8 indexer (inference)
FP8_TOL = 2e-3  # Hopper's fp8 wgmma accumulates with fewer bits than fp32


def _fp8_inputs(q, k, w):
    """fp8 inputs and what the float64 oracle sees: the dequantised keys (relu(q.k s) = s relu(q.k), s > 0)."""
    from dsa_plugins.ops import quantize_indexer_fp8

    q8, k8, k_scale, w8 = quantize_indexer_fp8(q, k, w)
    return q8, k8, k_scale, w8, q8.float(), k8.float() * k_scale[:, None]


@pytest.mark.parametrize("hi,di,T,k", [(64, 128, 1000, 256), (64, 128, 4096, 2048), (32, 128, 1000, 256),
                                       (32, 128, 4096, 2048), (16, 64, 1000, 256), (8, 32, 700, 100),
                                       (128, 128, 777, 300)])
def test_indexer_fp8_causal(hi, di, T, k):
    """Shipped (Hi 64 / 32, Di 128) and generic configurations."""
    from dsa_plugins import ops

    q, kk, w = make_inputs(T, T, hi, di, seed=hi + T)
    q8, k8, k_scale, w8, qd, kd = _fp8_inputs(q, kk, w)
    ks, ke = causal_windows([T])
    out = ops.indexer_topk(q8, k8, w8, k, ks, ke, backend="tilelang", index_k_scale=k_scale)
    rate = check_indexer_rows(out, qd, kd, w8, ks, ke, k, rel_tol=FP8_TOL)
    assert rate > 0.5, rate
    # the scale matters: without it other keys win
    out1 = K.indexer_topk(q8, k8, w8, ks, ke, k)
    assert not torch.equal(out1.sort(1).values, out.sort(1).values)


def test_indexer_fp8_windows_and_chunks():
    Tk, rows, k = 5000, 600, 300
    q, kk, w = make_inputs(rows, Tk, 64, 128, seed=21)
    q8, k8, k_scale, w8, qd, kd = _fp8_inputs(q, kk, w)
    g = torch.Generator(device="cuda").manual_seed(22)
    a = torch.randint(0, Tk, (rows,), device="cuda", generator=g)
    b = torch.randint(0, Tk + 1, (rows,), device="cuda", generator=g)
    ks, ke = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    ke[:5] = ks[:5]  # empty windows
    for budget in (K.DEFAULT_MAX_CHUNK_BYTES, 1 << 20):
        out = K.indexer_topk(q8, k8, w8, ks, ke, k, index_k_scale=k_scale, max_chunk_bytes=budget)
        check_indexer_rows(out, qd, kd, w8, ks, ke, k, rel_tol=FP8_TOL)
        assert bool((out[:5] == -1).all())


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_decode_rows_split_key_ranges(fp8, monkeypatch):
    """Generation: one query row per sequence over its own cache (packed keys). Few query blocks, so
    each block's key range is split over several CTAs; the answer is the same as one CTA per block."""
    lens = [3000, 5000, 1, 8191, 4096, 2500, 7000, 6000, 129, 9000]
    starts = torch.tensor([0] + lens[:-1], device="cuda").cumsum(0).to(torch.int32)
    ks, ke = starts, starts + torch.tensor(lens, device="cuda", dtype=torch.int32)
    B, Tk, k = len(lens), sum(lens), 2048
    q, kk, w = make_inputs(B, Tk, 64, 128, seed=31)
    k_scale = None
    if fp8:
        q, kk, k_scale, w, qd, kd = _fp8_inputs(q, kk, w)
    else:
        qd, kd = q, kk
    assert K._splits(B, -(-Tk // 128), q.device, one_row_blocks=True) > 1  # one row per CTA: generation steps
    out = K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale)
    check_indexer_rows(out, qd, kd, w, ks, ke, k, rel_tol=FP8_TOL if fp8 else 2e-5)
    monkeypatch.setattr(K, "_splits", lambda *a, **kw: 1)
    one = K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale)
    assert torch.equal(out.sort(1).values, one.sort(1).values)


@pytest.mark.parametrize("hi,di,fp8", [(64, 128, False), (32, 128, False), (16, 64, False), (64, 128, True)])
def test_indexer_decode_config_one_row_per_cta(hi, di, fp8):
    """Generation steps run one query row per CTA (DECODE_CONFIGS): the same sets as the prefill
    tiling, windows of every awkward length (empty, 1, < k, not a multiple of any block)."""
    lens = [3000, 0, 1, 8191, 129, 2047, 2049, 6000, 700]
    starts = torch.tensor([0] + lens[:-1], device="cuda").cumsum(0).to(torch.int32)
    ks, ke = starts, starts + torch.tensor(lens, device="cuda", dtype=torch.int32)
    B, Tk, k = len(lens), sum(lens), 2048
    q, kk, w = make_inputs(B, Tk, hi, di, seed=hi + di)
    k_scale, qd, kd = None, q, kk
    if fp8:
        q, kk, k_scale, w, qd, kd = _fp8_inputs(q, kk, w)
    assert K.default_config(hi, di, fp8, rows=B)["block_q"] == 1
    out = K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale)
    check_indexer_rows(out, qd, kd, w, ks, ke, k, rel_tol=FP8_TOL if fp8 else 2e-5)
    assert bool((out[1] == -1).all())
    prefill = K.indexer_topk(q, kk, w, ks, ke, k, index_k_scale=k_scale,
                             config=K.default_config(hi, di, fp8))
    assert torch.equal(out.sort(1).values, prefill.sort(1).values)


@pytest.mark.parametrize("rows_per_entry,block_q", [(1, 1), (2, 1), (3, 1), (8, 1), (1, 4), (2, 4), (3, 4), (5, 4)])
def test_indexer_batched_entries_bound_the_buffer(rows_per_entry, block_q):
    """With the batched layout declared (entries), each row's score buffer spans its own entry's keys
    only (no [rows, B * keys] buffer, no host sync); the sets are those of the unbounded call. With
    block_q 4 (the prefill plan) a block of rows spans entries whenever 4 does not divide S."""
    B, tk, k = 12, 5000, 1024
    S = rows_per_entry
    cfg = K.default_config(64, 128) if block_q == 4 else None
    assert cfg is None or cfg["block_q"] == 4
    q, kk, w = make_inputs(B * S, B * tk, 64, 128, seed=S)
    g = torch.Generator(device="cuda").manual_seed(S)
    lens = torch.randint(0, tk + 1, (B * S,), device="cuda", generator=g).int()
    lens[0] = 0
    lens[-1] = tk
    base = (torch.arange(B * S, device="cuda", dtype=torch.int32) // S) * tk
    offs = torch.randint(0, tk + 1, (B * S,), device="cuda", generator=g).int()
    ks = base + torch.minimum(offs, tk - lens)
    ke = ks + lens
    out = K.indexer_topk(q, kk, w, ks, ke, k, entries=(S, tk), config=cfg)
    check_indexer_rows(out, q, kk, w, ks, ke, k)
    free = K.indexer_topk(q, kk, w, ks, ke, k, config=cfg)
    assert torch.equal(out.sort(1).values, free.sort(1).values)


@pytest.mark.parametrize("rows_per_entry,block_q", [(1, 1), (3, 1), (3, 4), (5, 4)])
@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared"])
def test_indexer_entry_windows_are_the_batched_layout(rows_per_entry, block_q, shared):
    """entry_windows: windows in each entry's own key columns (per row, or [S] shared by the entries; starts
    below 0 and ends past the entry's keys clamped to them) and the result in those columns: bit for bit the
    global-window call on the same rows, less each entry's first key (-1 kept)."""
    B, tk, k = 6, 3000, 1024
    S = rows_per_entry
    cfg = K.default_config(64, 128) if block_q == 4 else None
    q, kk, w = make_inputs(B * S, B * tk, 64, 128, seed=S + 7)
    g = torch.Generator(device="cuda").manual_seed(S)
    n = S if shared else B * S
    lo = torch.randint(-50, tk, (n,), device="cuda", generator=g).int()
    hi = lo + torch.randint(0, tk + 100, (n,), device="cuda", generator=g).int()
    lo[0], hi[0] = 5, 5  # an empty window
    first = (torch.arange(B * S, device="cuda", dtype=torch.int32) // S) * tk
    rep = B if shared else 1
    ks = lo.clamp(0, tk).repeat(rep) + first
    ke = torch.maximum(hi.clamp(0, tk), lo.clamp(0, tk)).repeat(rep) + first
    want = K.indexer_topk(q, kk, w, ks, ke, k, entries=(S, tk), config=cfg)
    want = torch.where(want >= 0, want - first[:, None], want)
    got = K.indexer_topk(q, kk, w, lo, hi, k, entries=(S, tk), config=cfg, entry_windows=True)
    assert torch.equal(got, want)
    got, lse = K.indexer_topk(q, kk, w, lo, hi, k, entries=(S, tk), config=cfg, entry_windows=True, return_lse=True)
    _, want_lse = K.indexer_topk(q, kk, w, ks, ke, k, entries=(S, tk), config=cfg, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)


def test_indexer_generation_step_is_graph_capturable(monkeypatch):
    """A batched generation step through the public op (B 128, a 64K cache each: a [B, B * cache]
    buffer would take 4 GiB, over the 1 GiB budget, and need a host sync) plans one buffer of one
    entry's width, is captured in a CUDA graph and replays on new inputs."""
    from dsa_plugins import ops

    plans = []
    init = K._Plan.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plans.append(self)

    monkeypatch.setattr(K._Plan, "__init__", recording_init)
    B, tk, hi, di, k = 128, 65536, 64, 128, 2048
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(B, 1, hi, di, device="cuda", generator=g).bfloat16()
    kk = torch.randn(B, tk, di, device="cuda", generator=g).bfloat16()
    w = torch.randn(B, 1, hi, device="cuda", generator=g) * (hi**-0.5 * di**-0.5)
    end = torch.randint(1, tk + 1, (B, 1), device="cuda", generator=g)
    start = torch.zeros_like(end)
    step = lambda: ops.indexer_topk(q, kk, w, k, start, end, backend="tilelang")  # noqa: E731
    step()
    torch.cuda.synchronize()
    plan = plans[-1]
    assert plan.bq == 1 and len(plan.chunks) == 1, plan.chunks  # one row per CTA, one buffer
    assert plan.chunks[0][2] * plan.bk <= tk + 2 * plan.bk, plan.chunks  # one cache wide, not B caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (6, 7):
        q.copy_(torch.randn(q.shape, device="cuda", generator=g.manual_seed(seed)).bfloat16())
        end.copy_(torch.randint(1, tk + 1, (B, 1), device="cuda", generator=g))
        graph.replay()
        eager = step()
        assert torch.equal(captured.sort(-1).values, eager.sort(-1).values)
    rows = torch.arange(B, device="cuda")[:8]
    flat_k = kk.reshape(B * tk, di)
    ks = (rows * tk).int()
    sel = torch.where(eager[rows, 0] >= 0, eager[rows, 0] + ks[:, None], -1)
    check_indexer_rows(sel, q[rows, 0], flat_k, w[rows, 0], ks, ks + end[rows, 0].int(), k)


@pytest.mark.parametrize("budget", [None, 1 << 20])
def test_indexer_selected_lse(budget):
    """return_lse: each row's logsumexp over the scores of the keys it selected (float64 scores of the returned
    rows), -inf for an empty window; the rows are those of the plain call; one chunk or many."""
    Tk, rows, k = 3000, 500, 300
    q, kk, w = make_inputs(rows, Tk, 64, 128, seed=9)
    g = torch.Generator(device="cuda").manual_seed(10)
    a = torch.randint(0, Tk, (rows,), device="cuda", generator=g)
    b = torch.randint(0, Tk + 1, (rows,), device="cuda", generator=g)
    ks, ke = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    ke[:4] = ks[:4]  # empty windows
    ke[4:8] = ks[4:8] + 5  # fewer keys than k: -1 slots
    extra = {} if budget is None else {"max_chunk_bytes": budget}
    out, lse = K.indexer_topk(q, kk, w, ks, ke, k, return_lse=True, **extra)
    plain = K.indexer_topk(q, kk, w, ks, ke, k, **extra)  # the same sets (the order in a row is unspecified)
    assert torch.equal(out.sort(1).values, plain.sort(1).values)
    assert lse.shape == (rows,) and lse.dtype == torch.float32
    s = ref_scores(q, kk, w, torch.arange(rows, device="cuda"), 0, Tk)
    picked = s.gather(1, out.long().clamp(min=0)).masked_fill(out < 0, float("-inf"))
    want = torch.logsumexp(picked, 1)
    assert bool((lse[:4] == float("-inf")).all())
    assert torch.isfinite(lse[4:]).all()
    err = (lse[4:].double() - want[4:]).abs().max().item()
    assert err <= 1e-5 * max(1.0, want[4:].abs().max().item()), f"lse max abs err {err:.3e}"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("hi", [64, 32])
def test_indexer_pingpong_program_gives_the_shipped_scores(hi, fp8):
    """The hand-specialised score program (``pingpong``: one consumer's epilogue beside the other's MMAs; the
    prefill's for 32 and 64 index heads) writes the tiled program's scores at every key of every window (T not a
    multiple of any block, empty windows, windows that start inside a key block): bit for bit where both take
    the same block_q (the same m64nN MMA per 64 keys, the same head sum); where the tiled one takes fewer
    queries per block (bf16 Hi 32: block_q 4 against 8, a narrower MMA) to fp32 rounding, with the reference's
    selections."""
    from dsa_plugins.ops import quantize_indexer_fp8

    T, Tk, k = 1001, 1500, 300
    q, kk, w = make_inputs(T, Tk, hi, 128, seed=40 + hi)
    scale = None
    if fp8:
        q, kk, scale, w = quantize_indexer_fp8(q, kk, w)
    g = torch.Generator(device="cuda").manual_seed(41)
    a = torch.randint(0, Tk, (T,), device="cuda", generator=g)
    b = torch.randint(0, Tk + 1, (T,), device="cuda", generator=g)
    ks, ke = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    ke[:7] = ks[:7]  # empty windows
    shipped = K.default_config(hi, 128, fp8, tiled=True)
    pingpong = K.default_config(hi, 128, fp8)
    assert pingpong.get("pingpong") and pingpong["block_k"] == 64
    dense = []
    for cfg in (shipped, pingpong):
        plan = K._Plan(q, kk, w, ks, ke, cfg, 1 << 62, index_k_scale=scale)
        (chunk,) = plan.chunks
        r0, r1, buf = plan.chunk_scores(chunk)
        cols = torch.arange(buf.shape[1], device="cuda")
        inside = (cols[None, :] >= plan.ks[:, None]) & (cols[None, :] < plan.ke[:, None])
        full = torch.full((T, Tk), float("nan"), device="cuda")
        rows = torch.arange(T, device="cuda")[:, None].expand_as(inside)
        full[rows[inside], (plan.base[:, None] + cols[None, :]).expand_as(inside)[inside]] = buf[inside]
        dense.append(full)
    seen = ~torch.isnan(dense[0])
    assert torch.equal(seen, ~torch.isnan(dense[1]))
    assert int(seen.sum()) == int((ke - ks).clamp(min=0).sum())
    out = [K.indexer_topk(q, kk, w, ks, ke, k, config=cfg, index_k_scale=scale) for cfg in (shipped, pingpong)]
    if shipped["block_q"] == pingpong["block_q"]:
        assert torch.equal(dense[0][seen], dense[1][seen])
        assert torch.equal(out[0].sort(1).values, out[1].sort(1).values)
    else:
        a, b = dense[0][seen], dense[1][seen]
        assert not torch.isnan(b).any() and (a - b).abs().max() <= 1e-5 * a.abs().max()
        assert check_indexer_rows(out[1], q, kk, w, ks, ke, k) > 0.98
