"""GPU test of the TileLang sparse attention forward against a float64 oracle written here.

Awkward cases: -1 padding, indices >= Skv and < -1, rows without any valid key, duplicates,
K not a multiple of the block, K = 1, K > Skv, sinks very large / very negative, odd S, B = 2,
H in {16, 32, 64, 128}, both shipped model shapes and small dims. Outputs are poisoned with NaN
before the call; every element must be written and finite. kv rows that are never selected are
NaN and kv sits inside a NaN-filled allocation, so a read of kv[-1] or past the end shows up as NaN.
"""

import math
import random
import zlib

import pytest
import torch

from tests.helpers import misaligned_view

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def reference(q, kv, indices, scale, sink, dv):
    """float64 oracle: gather rows, masked softmax. Returns out [B,S,H,dv] f64, lse [B,S,H] f64."""
    b, s, _, d = q.shape
    skv = kv.shape[1]
    k = indices.shape[-1]
    idx = indices.long()
    valid = (idx >= 0) & (idx < skv)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    rows = torch.gather(kv.double(), 1, safe.reshape(b, s * k, 1).expand(b, s * k, d)).reshape(b, s, k, d)
    rows = torch.where(valid[..., None], rows, torch.zeros_like(rows))  # never touch unselected rows
    scores = torch.einsum("bshd,bskd->bshk", q.double(), rows) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    p = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse)[..., None])
    out = torch.einsum("bshk,bskd->bshd", p, rows[..., :dv])
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.double()[None, None, :])[..., None]
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
    return out, lse


def make_kv(b, skv, d, dtype, device, gen):
    """kv [b, skv, d] contiguous inside a NaN buffer; rows 0 and skv-1 of every batch are NaN."""
    flat = torch.full(((b * skv + 2) * d,), math.nan, dtype=dtype, device=device)
    kv = flat[d : d + b * skv * d].view(b, skv, d)
    kv.copy_(torch.randn(b, skv, d, generator=gen, device=device).to(dtype))
    if skv >= 4:
        kv[:, 0] = math.nan
        kv[:, -1] = math.nan
    return kv


def make_indices(b, s, k, skv, mode, device, gen):
    lo, hi = (1, skv - 1) if skv >= 4 else (0, skv)  # rows 0 and skv-1 are NaN: never select them

    def rand(*shape, low=lo, high=hi):
        return torch.randint(low, high, shape, generator=gen, device=device, dtype=torch.int64)

    idx = rand(b, s, k)
    if mode == "random":
        pass
    elif mode == "pad":  # valid prefix of random length per row, then -1
        lengths = rand(b, s, 1, low=0, high=k + 1)
        idx = torch.where(torch.arange(k, device=device) < lengths, idx, torch.full_like(idx, -1))
    elif mode == "oob":  # -1, < -1 and >= skv mixed in
        bad = torch.tensor([-1, -2, -1000, -(2**31), skv, skv + 1, skv + 1000, 2**31 - 1], device=device)
        pick = bad[rand(b, s, k, low=0, high=len(bad))]
        idx = torch.where(rand(b, s, k, low=0, high=3) == 0, pick, idx)
    elif mode == "empty_rows":  # some rows entirely invalid, the rest padded
        idx = torch.where(rand(b, s, k, low=0, high=4) == 0, torch.full_like(idx, -1), idx)
        idx[:, ::2] = -1
    elif mode == "all_invalid":
        idx = torch.where(rand(b, s, k, low=0, high=2) == 0, torch.full_like(idx, -1), torch.full_like(idx, skv))
    elif mode == "dup":  # few distinct rows, many duplicates
        idx = rand(b, s, k, low=lo, high=min(hi, lo + 3))
    elif mode == "causal":  # row t sees keys <= t (scaled onto skv), padded with -1
        t = torch.arange(s, device=device).view(1, s, 1) * (skv - 2) // max(s, 1) + 1
        idx = torch.where(idx <= t, idx, torch.full_like(idx, -1))
    else:
        raise ValueError(mode)
    return idx.to(torch.int32)


def make_sink(h, mode, device, gen):
    if mode is None:
        return None
    if mode == "randn":
        return torch.randn(h, generator=gen, device=device, dtype=torch.float32)
    if mode == "large":
        return torch.full((h,), 40.0, device=device)
    if mode == "negative":
        return torch.full((h,), -40.0, device=device)
    if mode == "extreme":  # +-1e4 alternating: exp overflows / underflows
        return torch.tensor([1e4 if i % 2 else -1e4 for i in range(h)], device=device, dtype=torch.float32)
    raise ValueError(mode)


# (B, S, H, Dqk, Dv, K, Skv, index mode, sink mode)
CASES = []
for h in (16, 32, 64, 128):
    CASES += [
        (1, 3, h, 512, 512, 1024, 2048, "random", "randn"),
        (2, 5, h, 512, 512, 200, 300, "pad", "randn"),
        (1, 17, h, 512, 512, 129, 100, "oob", "large"),
        (1, 4, h, 512, 512, 64, 80, "empty_rows", "negative"),
        (1, 3, h, 576, 512, 2048, 4096, "random", None),
        (2, 3, h, 576, 512, 300, 257, "pad", None),
        (1, 7, h, 576, 512, 1, 50, "random", None),
        (1, 9, h, 576, 512, 333, 40, "dup", None),
    ]
CASES += [
    (1, 1, 128, 576, 512, 4096, 8192, "causal", None),
    (1, 1, 64, 512, 512, 4096, 8192, "causal", "randn"),
    (2, 3, 128, 576, 512, 2048, 3000, "oob", None),
    (1, 5, 64, 512, 512, 100, 10, "all_invalid", "randn"),
    (1, 5, 128, 576, 512, 100, 10, "all_invalid", None),
    (1, 6, 32, 512, 512, 513, 1000, "causal", "extreme"),
    (2, 17, 16, 576, 512, 257, 100, "oob", None),
    (1, 3, 128, 512, 512, 1024, 5, "random", "randn"),  # K far above Skv
    (1, 11, 16, 64, 64, 64, 100, "random", "randn"),
    (2, 13, 32, 64, 64, 100, 50, "oob", None),
    (1, 5, 64, 64, 64, 1, 3, "random", None),
    (1, 3, 128, 64, 64, 700, 1000, "empty_rows", "extreme"),
    (2, 7, 16, 96, 64, 130, 200, "pad", None),
    (1, 9, 64, 96, 64, 256, 64, "dup", None),
    (1, 33, 128, 96, 64, 65, 1000, "oob", None),
]


SCHEDULES = ("qk_one", "split", "qk_one_async", "seesaw")


def _run_case(case, dtype=torch.bfloat16, scale_mult=1.0, seed=0, schedule=None, part_slots=None, cluster_parts=None):
    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch

    b, s, h, dqk, dv, k, skv, mode, sink_mode = case
    device = torch.device("cuda")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + zlib.crc32(repr(case).encode()))
    q = torch.randn(b, s, h, dqk, generator=gen, device=device).to(dtype)
    kv = make_kv(b, skv, dqk, dtype, device, gen)
    idx = make_indices(b, s, k, skv, mode, device, gen)
    sink = make_sink(h, sink_mode, device, gen)
    scale = scale_mult * dqk**-0.5

    out = torch.full((b, s, h, dv), math.nan, dtype=dtype, device=device)
    lse = torch.full((b, s, h), math.nan, dtype=torch.float32, device=device)
    sc, dv_ = _check_inputs(q, kv, idx, scale, sink, dv)
    _launch(q, kv, idx, sc, sink, dv_, out, lse, overrides={"schedule": schedule} if schedule else None,
            part_slots=part_slots, cluster_parts=cluster_parts)
    torch.cuda.synchronize()

    ref_out, ref_lse = reference(q, kv, idx, scale, sink, dv)
    empty = torch.isinf(ref_lse)
    assert not torch.isnan(out).any(), f"{case}: NaN in out ({int(torch.isnan(out).sum())} elements)"
    assert not torch.isnan(lse).any(), f"{case}: NaN in lse ({int(torch.isnan(lse).sum())} elements)"
    assert torch.isfinite(out).all(), f"{case}: inf in out"
    assert torch.equal(torch.isinf(lse), empty), f"{case}: lse is +inf exactly where a row has no valid key"
    assert (lse[empty] > 0).all(), f"{case}: lse of an empty row must be +inf"
    assert (out[empty] == 0).all(), f"{case}: rows without a valid key must give out = 0"

    o = out.double()
    err = (o - ref_out).abs().max().item()
    ref_scale = max(ref_out.abs().max().item(), 1e-3)
    assert err <= 1.5e-2 * ref_scale + 1e-3, f"{case}: out max abs error {err:.3e} (ref max {ref_scale:.3e})"
    if (~empty).any():
        lerr = ((lse.double() - ref_lse)[~empty]).abs().max().item()
        assert lerr <= 2e-3 + 1e-3 * ref_lse[~empty].abs().max().item(), f"{case}: lse max abs error {lerr:.3e}"
    return err


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}S{c[1]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}-{c[8]}" for c in CASES])
def test_sparse_attention_fwd_matches_float64(case, schedule):
    _run_case(case, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_peaky_scores(schedule):
    """A large scale makes each softmax nearly one-hot: stresses the running max."""
    _run_case((1, 9, 64, 576, 512, 500, 700, "random", None), scale_mult=8.0, schedule=schedule)
    _run_case((1, 9, 128, 512, 512, 500, 700, "pad", "randn"), scale_mult=8.0, schedule=schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fresh_random_draws(schedule):
    """Random shapes on every run (seeded per draw so a failure can be reproduced from its message)."""
    rng = random.Random()
    for _ in range(4):
        seed = rng.randrange(1 << 30)
        r = random.Random(seed)
        dqk, dv, sink = r.choice([(512, 512, "randn"), (576, 512, None), (64, 64, "randn"), (96, 64, None)])
        case = (r.choice([1, 2]), r.randrange(1, 20), r.choice([16, 32, 64, 128]), dqk, dv,
                r.randrange(1, 700), r.randrange(2, 1500), r.choice(["random", "pad", "oob", "dup", "causal"]), sink)
        try:
            _run_case(case, seed=seed, schedule=schedule)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from None


def test_public_wrapper_and_float16():
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    q = torch.randn(2, 3, 64, 576, generator=gen, device="cuda").to(torch.bfloat16)
    kv = torch.randn(2, 300, 576, generator=gen, device="cuda").to(torch.bfloat16)
    idx = torch.randint(-1, 300, (2, 3, 100), generator=gen, device="cuda", dtype=torch.int64)  # int64 accepted
    out, lse = sparse_attention_fwd(q, kv, idx, 0.05, dv=512)
    ref_out, _ = reference(q, kv, idx, 0.05, None, 512)
    assert out.shape == (2, 3, 64, 512) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (out.double() - ref_out).abs().max().item() < 1.5e-2 * ref_out.abs().max().item() + 1e-3
    # int64 indices outside the int32 range stay invalid (no wrap-around onto a valid row)
    idx_far = idx.clone()
    idx_far[..., ::3] = 2**32 + 5
    out3, _ = sparse_attention_fwd(q, kv, idx_far, 0.05, dv=512)
    ref3, _ = reference(q, kv, torch.where(idx_far >= 300, -1, idx_far), 0.05, None, 512)
    assert (out3.double() - ref3).abs().max().item() < 1.5e-2 * ref3.abs().max().item() + 1e-3
    # non-contiguous q is normalised
    out2, _ = sparse_attention_fwd(q.transpose(1, 2).contiguous().transpose(1, 2), kv, idx, 0.05, dv=512)
    assert torch.equal(out, out2)
    _run_case((1, 5, 64, 576, 512, 300, 400, "pad", None), dtype=torch.float16)


def test_misaligned_q_and_out_views():
    """q and out are TMA tensors, kv is gathered by cp.async (16-byte aligned bases): views at an odd element
    offset give the same bits as aligned tensors (q and kv copied, out written through an aligned buffer)."""
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    b, s, h, dqk, dv, skv = 1, 5, 16, 576, 512, 200
    q_buf = torch.randn(b * s * h * dqk + 1, generator=gen, device="cuda").bfloat16()
    q_odd = q_buf[1:].view(b, s, h, dqk)
    kv = torch.randn(b, skv, dqk, generator=gen, device="cuda").bfloat16()
    idx = torch.randint(-1, skv, (b, s, 70), generator=gen, device="cuda", dtype=torch.int32)
    out_buf = torch.full((b * s * h * dv + 1,), math.nan, dtype=torch.bfloat16, device="cuda")
    out_odd = out_buf[1:].view(b, s, h, dv)
    assert q_odd.data_ptr() % 16 and out_odd.data_ptr() % 16
    out_ref, lse_ref = sparse_attention_fwd(q_odd.clone(), kv, idx, 0.05, dv=dv)
    _, lse = sparse_attention_fwd(q_odd, kv, idx, 0.05, dv=dv, out=out_odd)
    assert torch.equal(out_odd, out_ref) and torch.equal(lse, lse_ref)
    assert out_buf[0].isnan()  # nothing written before the view
    kv_odd = misaligned_view(kv)
    out_kv, lse_kv = sparse_attention_fwd(q_odd, kv_odd, idx, 0.05, dv=dv)
    assert torch.equal(out_kv, out_ref) and torch.equal(lse_kv, lse_ref)


def test_new_lengths_do_not_recompile():
    from dsa_plugins.kernels import sparse_attention_fwd as mod

    _run_case((1, 3, 64, 512, 512, 128, 200, "random", "randn"))
    _run_case((3, 1, 64, 512, 512, 1000, 1500, "random", "randn"))  # decode rows: the program for k's parts
    before = len(mod._kernels)
    for s, skv, k in ((5, 333, 77), (1, 4000, 1000), (2, 17, 3)):
        _run_case((2, s, 32, 512, 512, k, skv, "pad", "randn"))
    assert len(mod._kernels) == before


def _same_bits_and_reference(case, overrides, seed_offset=0):
    """Run the model-dim case under each of two ``overrides`` (compile-time variants that must not change
    the result): the same bits, and the reference's values."""
    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch

    b, s, h, dqk, dv, k, skv, mode, sink_mode = case
    gen = torch.Generator(device="cuda")
    gen.manual_seed(zlib.crc32(repr(case).encode()) + seed_offset)
    q = torch.randn(b, s, h, dqk, generator=gen, device="cuda").bfloat16()
    kv = make_kv(b, skv, dqk, torch.bfloat16, torch.device("cuda"), gen)
    idx = make_indices(b, s, k, skv, mode, torch.device("cuda"), gen)
    sink = make_sink(h, sink_mode, torch.device("cuda"), gen)
    sc, dv_ = _check_inputs(q, kv, idx, dqk**-0.5, sink, dv)
    outs = []
    for over in overrides:
        out = torch.full((b, s, h, dv), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, s, h), math.nan, dtype=torch.float32, device="cuda")
        _launch(q, kv, idx, sc, sink, dv_, out, lse, overrides=over)
        outs.append((out, lse))
    (o0, l0), (o1, l1) = outs
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
    ref_out, _ = reference(q, kv, idx, dqk**-0.5, sink, dv)
    assert (o1.double() - ref_out).abs().max().item() <= 1.5e-2 * max(ref_out.abs().max().item(), 1e-3) + 1e-3


@pytest.mark.parametrize("case", [c for c in CASES if c[7] in ("causal", "empty_rows", "all_invalid", "pad", "oob")
                                  and c[3] >= 512],  # the model dims: two programs to compile
                         ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}")
@pytest.mark.parametrize("schedule", ("qk_one", "seesaw"))
def test_skip_tail_is_bitwise_the_full_walk(case, schedule):
    """skip_tail (each row stops after its last valid slot, empty rows run no trip) gives the same
    bits as walking every slot block, and the reference's values."""
    _same_bits_and_reference(case, [{"skip_tail": skip, "schedule": schedule} for skip in (False, True)])


@pytest.mark.parametrize("case", [c for c in CASES if c[3] >= 512],  # the model dims: two programs to compile
                         ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}")
def test_persistent_grid_is_bitwise_the_plain_grid(case):
    """persistent_ctas: 5 CTAs walk every row block in turn (several per CTA, rows without a trip
    among them, the barrier phases carried from block to block): the same bits as one CTA per row
    block, and the reference's values."""
    _same_bits_and_reference(case, [{"schedule": "qk_one"}, {"persistent_ctas": 5}], seed_offset=1)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] >= 512],  # the model dims: two programs to compile
                         ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}")
def test_tma_io_is_bitwise_the_thread_copies(case):
    """tma_io: Q in by TMA (head rows past H zero-filled by the tensor bounds) and the output out by
    TMA stores, one 64-column tile at a time (rows past H not written): the same bits as the threads'
    own loads and stores, and the reference's values."""
    _same_bits_and_reference(case, [{"tma_io": False}, {"tma_io": True}], seed_offset=2)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] >= 512],  # the model dims: two programs to compile
                         ids=lambda c: f"B{c[0]}S{c[1]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}")
@pytest.mark.parametrize("repeat", range(3))
def test_seesaw_without_auto_sync_is_bitwise_with_it(case, repeat):
    """The seesaw runs without TileLang's automatic warpgroup syncs (its own barriers order its shared
    memory): the same bits as with them, run after run."""
    from dsa_plugins.kernels.sparse_attention_fwd import _normalise_config

    assert _normalise_config({"schedule": "seesaw"})["auto_sync"] is False
    seesaw = {"schedule": "seesaw"}
    _same_bits_and_reference(case, [{**seesaw, "auto_sync": True}, seesaw], seed_offset=4 + repeat)


@pytest.mark.parametrize("h", (16, 64, 128))
@pytest.mark.parametrize("dims", ((576, 512, None), (512, 512, "randn")))
def test_prefill_and_whole_decode_rows_run_seesaw_and_parts_qk_one(dims, h):
    """The op's schedules: rows of a prefill (S > 1, or decode=False) and generation steps left whole (128
    heads) take the seesaw program, generation steps cut into parts (16 and 64 heads) qk_one's, whatever the
    batch; each bitwise the program named explicitly."""
    from dsa_plugins.common.settings import decode_cluster_parts
    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch, sparse_attention_fwd

    dqk, dv, sink_mode = dims
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7 + h + dqk)
    step = "seesaw" if decode_cluster_parts(700, h) == 0 else "qk_one"
    assert (step == "seesaw") == (h == 128)
    for s, b, decode, named in ((9, 2, None, "seesaw"), (1, 3, False, "seesaw"), (1, 3, None, step)):
        q = torch.randn(b, s, h, dqk, generator=gen, device="cuda").bfloat16()
        kv = make_kv(b, 3001, dqk, torch.bfloat16, torch.device("cuda"), gen)
        idx = make_indices(b, s, 700, 3001, "random", torch.device("cuda"), gen)
        sink = make_sink(h, sink_mode, torch.device("cuda"), gen)
        out, lse = sparse_attention_fwd(q, kv, idx, dqk**-0.5, sink, dv, decode=decode)
        sc, dv_ = _check_inputs(q, kv, idx, dqk**-0.5, sink, dv)
        o2, l2 = torch.empty_like(out), torch.empty_like(lse)
        _launch(q, kv, idx, sc, sink, dv_, o2, l2, overrides={"schedule": named}, decode=decode)
        assert torch.equal(out, o2) and torch.equal(lse, l2), (s, decode, named)
        # the other schedule differs in the last bits somewhere: the check can fail
        other = "qk_one" if named == "seesaw" else "seesaw"
        _launch(q, kv, idx, sc, sink, dv_, o2, l2, overrides={"schedule": other}, decode=decode)
        assert not (torch.equal(out, o2) and torch.equal(lse, l2)), (s, decode, named)
    if step == "seesaw":  # a generation step left whole: the bits its row gives inside a prefill
        q2 = torch.cat([q, torch.randn_like(q)], dim=1)
        idx2 = torch.cat([idx, idx.flip(-1)], dim=1)
        out2, lse2 = sparse_attention_fwd(q2, kv, idx2, dqk**-0.5, sink, dv)
        assert torch.equal(out, out2[:, :1]) and torch.equal(lse, lse2[:, :1])


# Decode: one query per row, the slots split into parts scored by CTAs of their own, merged by the combine
# program (DSA_PLUGINS_DECODE_PART_SLOTS) or inside a cluster (the default, cluster_parts); lengths that are
# multiples of no block
DECODE_CASES = []
for h in (16, 64, 128):
    DECODE_CASES += [
        (1, 1, h, 576, 512, 2048, 32771, "random", None),
        (3, 1, h, 512, 512, 513, 1001, "pad", "randn"),
        (2, 1, h, 576, 512, 2049, 3000, "oob", None),
        (4, 1, h, 512, 512, 700, 700, "empty_rows", "extreme"),
        (2, 1, h, 576, 512, 1500, 333, "dup", None),
        (2, 1, h, 512, 512, 1025, 4097, "random", "large"),
    ]
DECODE_CASES += [
    (2, 1, 64, 576, 512, 1024, 5000, "all_invalid", None),
    (3, 1, 128, 512, 512, 3000, 9000, "all_invalid", "randn"),
    (1, 1, 64, 64, 64, 1000, 3000, "random", "randn"),
    (2, 1, 32, 96, 64, 777, 999, "pad", None),
    (5, 1, 64, 576, 512, 511, 2000, "random", None),  # within one 512-slot part; 8 cluster parts: some empty
]


@pytest.mark.parametrize("schedule", ("qk_one", "seesaw"))
@pytest.mark.parametrize("parts", (2, 4, 8))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}-{c[8]}")
def test_decode_cluster_split_matches_float64(case, parts, schedule):
    """The parts of each row (some with no valid slot: k 511 in 8 parts of 128) merged through distributed
    shared memory, on either schedule that has the split: the reference's values, empty rows out 0 and lse
    +inf, no NaN."""
    _run_case(case, cluster_parts=parts, schedule=schedule)


@pytest.mark.parametrize("schedule", ("qk_one", "seesaw"))
@pytest.mark.parametrize("case", [DECODE_CASES[i] for i in (0, 3, 6)], ids=lambda c: f"B{c[0]}H{c[2]}D{c[3]}-{c[7]}")
def test_decode_cluster_split_float16(case, schedule):
    """float16 rows through the cluster split (its hi + lo halves and their conversion are fp16 there)."""
    _run_case(case, dtype=torch.float16, cluster_parts=4, schedule=schedule)


@pytest.mark.parametrize("part_slots", (512, 128))
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"B{c[0]}H{c[2]}D{c[3]}-{c[4]}K{c[5]}Skv{c[6]}-{c[7]}-{c[8]}")
def test_decode_split_matches_float64(case, part_slots):
    from dsa_plugins.kernels import sparse_attention_fwd as mod

    _run_case(case, part_slots=part_slots)
    if case[5] > part_slots:  # the partial program served it
        # the cache key is (target,) + the compile keys: find the partial flag by name (key[-1] once read
        # whichever key came last, and passed on other tests' kernels)
        partial_at = 1 + mod._COMPILE_KEYS.index("partial")
        assert any(key[partial_at] for key in mod._kernels), "the decode split did not run"


@pytest.mark.parametrize("split", ("cluster", "part_slots"))
@pytest.mark.parametrize("h, dqk, sink_mode", [(64, 576, None), (128, 512, "randn"), (16, 576, None)])
def test_decode_rows_are_batch_invariant(h, dqk, sink_mode, split, monkeypatch):
    """A row's output and lse are the same bits alone and in a batch (the part count depends on k only): the
    default cluster split and DSA_PLUGINS_DECODE_PART_SLOTS's."""
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    if split == "part_slots":
        monkeypatch.setenv("DSA_PLUGINS_DECODE_PART_SLOTS", "512")
    else:
        monkeypatch.delenv("DSA_PLUGINS_DECODE_PART_SLOTS", raising=False)
        monkeypatch.setenv("DSA_PLUGINS_DECODE_ROW_CTAS", "8")  # the most parts (4 at H 128, 8 below)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(h + dqk)
    b, skv, k = 5, 4000, 2048
    q = torch.randn(b, 1, h, dqk, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(b, skv, dqk, generator=gen, device="cuda").bfloat16()
    idx = make_indices(b, 1, k, skv, "pad", torch.device("cuda"), gen)
    sink = make_sink(h, sink_mode, torch.device("cuda"), gen)
    from dsa_plugins.kernels import sparse_attention_fwd as mod

    built = []  # the programs this test's calls launch (the split must be one of them)
    real_build = mod.build_fwd_kernel
    monkeypatch.setattr(mod, "build_fwd_kernel", lambda cfg, target="auto": built.append(cfg) or real_build(cfg, target))
    out, lse = sparse_attention_fwd(q, kv, idx, dqk**-0.5, sink=sink, dv=512)
    key = "cluster_parts" if split == "cluster" else "partial"
    assert any(cfg.get(key) for cfg in built), f"the {split} split did not run"
    for i in range(b):
        o1, l1 = sparse_attention_fwd(q[i : i + 1], kv[i : i + 1], idx[i : i + 1], dqk**-0.5, sink=sink, dv=512)
        assert torch.equal(o1, out[i : i + 1]) and torch.equal(l1, lse[i : i + 1]), f"row {i} differs alone"


@pytest.mark.parametrize("decode", (True, False), ids=("decode_path", "prefill_path"))
@pytest.mark.parametrize("h, dqk, mode", [(64, 576, "pad"), (128, 512, "empty_rows"), (16, 576, "oob")])
def test_decode_rows_walk_all_trips_with_the_same_bits(h, dqk, mode, decode, monkeypatch):
    """One-query rows skip the per-row trip counts (they walk every trip of their slots); each
    such row on one CTA (no split) gives the bits the same row gives inside a two-row launch (trips
    from the indices) of the same path (decode=True: generation steps', False: the prefill's; rows left
    whole run the seesaw on both)."""
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    monkeypatch.setenv("DSA_PLUGINS_DECODE_ROW_CTAS", "0")
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11 * h + dqk)
    b, skv, k = 3, 3001, 1000
    dv = 512
    sink = make_sink(h, "randn" if dqk == dv else None, torch.device("cuda"), gen)
    q = torch.randn(b, 2, h, dqk, generator=gen, device="cuda").bfloat16()
    kv = torch.randn(b, skv, dqk, generator=gen, device="cuda").bfloat16()
    idx = make_indices(b, 2, k, skv, mode, torch.device("cuda"), gen)
    idx[0, 0] = -1  # a decode row with no key at all
    idx[1, 0, 7:] = -1  # a decode row with a short cache
    out2, lse2 = sparse_attention_fwd(q, kv, idx, dqk**-0.5, sink=sink, dv=dv, decode=decode)  # counted trips
    out1, lse1 = sparse_attention_fwd(q[:, :1].contiguous(), kv, idx[:, :1].contiguous(), dqk**-0.5, sink=sink,
                                      dv=dv, decode=decode)  # one row each: every trip
    assert torch.equal(out1, out2[:, :1]) and torch.equal(lse1, lse2[:, :1])
    assert torch.equal(out1[0], torch.zeros_like(out1[0])) and torch.isinf(lse1[0]).all()
    assert torch.isfinite(out1).all()


def test_decode_split_agrees_with_one_part_and_keeps_nan():
    """The splits (through HBM partials, inside a cluster) and the one-CTA walk agree to bf16 rounding; a
    NaN query head gives NaN in that head only, in out and lse."""
    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    b, h, dqk, k, skv = 3, 64, 576, 2048, 6000
    q = torch.randn(b, 1, h, dqk, generator=gen, device="cuda").bfloat16()
    q[1, 0, 5] = math.nan
    kv = make_kv(b, skv, dqk, torch.bfloat16, torch.device("cuda"), gen)
    idx = make_indices(b, 1, k, skv, "random", torch.device("cuda"), gen)
    sc, dv = _check_inputs(q, kv, idx, dqk**-0.5, None, 512)
    res = []
    for part_slots, parts, schedule in ((512, 0, None), (0, 8, None), (0, 8, "seesaw"), (0, 0, None)):
        out = torch.full((b, 1, h, dv), math.nan, dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, 1, h), math.nan, device="cuda")
        _launch(q, kv, idx, sc, None, dv, out, lse, part_slots=part_slots, cluster_parts=parts,
                overrides={"schedule": schedule} if schedule else None)
        res.append((out, lse))
    o_one, l_one = res[-1]
    nan_head = torch.zeros(b, 1, h, dtype=torch.bool, device="cuda")
    nan_head[1, 0, 5] = True
    for o, lse_ in res:
        assert torch.isnan(o[nan_head]).all() and torch.isnan(lse_[nan_head]).all()
        assert not torch.isnan(o[~nan_head]).any() and not torch.isnan(lse_[~nan_head]).any()
    ref_out, ref_lse = reference(q, kv, idx, dqk**-0.5, None, dv)
    keep = ~nan_head
    for o, lse_ in res:
        err = (o.double() - ref_out)[keep].abs().max().item()
        assert err <= 1.5e-2 * ref_out[keep].abs().max().item() + 1e-3
        assert (lse_.double() - ref_lse)[keep].abs().max().item() <= 2e-3 + 1e-3 * ref_lse[keep].abs().max().item()
    for name, (o_split, _) in zip(("HBM partials", "cluster", "cluster, seesaw"), res[:3]):
        d = (o_split.double() - o_one.double())[keep].abs().max().item()
        assert d <= 1e-2 * o_one[keep].double().abs().max().item(), f"split ({name}) vs one part: {d:.3e}"
