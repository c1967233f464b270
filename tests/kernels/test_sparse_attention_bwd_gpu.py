"""GPU checks of the TileLang sparse attention backward against float64 autograd.

The oracle (written here, independent of dsa_plugins.reference) runs the forward math in float64
with torch autograd: dq, dkv and dsink of the kernel must match it within bf16 tolerances
(norm-relative error), never NaN; deterministic mode must be bitwise reproducible.
"""

import math
import zlib

import pytest
import torch

from tests.helpers import misaligned_view

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOL = 1e-2


def _ref_forward(q, kv, indices, scale, sink, dv):
    """float64 forward with autograd: (out, lse) with lse +inf on rows without a valid slot."""
    B, S, H, D = q.shape
    Skv = kv.shape[1]
    valid = (indices >= 0) & (indices < Skv)  # [B,S,K]
    idx = torch.where(valid, indices, torch.zeros_like(indices)).long()
    kvg = torch.gather(kv.unsqueeze(1).expand(B, S, Skv, D), 2, idx.unsqueeze(-1).expand(B, S, idx.shape[-1], D))
    s = torch.einsum("bshd,bskd->bshk", q, kvg) * scale
    has = valid.any(-1)  # [B,S]
    s = s.masked_fill(~valid.unsqueeze(2), float("-inf"))
    s = torch.where(has[:, :, None, None], s, torch.zeros_like(s))  # keep empty rows finite
    lse = torch.logsumexp(s, -1)  # [B,S,H]
    norm = lse if sink is None else torch.logaddexp(lse, sink.view(1, 1, H))
    p = torch.exp(s - norm.unsqueeze(-1)) * valid.unsqueeze(2).to(s.dtype)
    out = torch.einsum("bshk,bskd->bshd", p, kvg[..., :dv])
    lse_out = torch.where(has.unsqueeze(-1), lse, torch.full_like(lse, math.inf))
    return out, lse_out


def _given_p(q, kv, indices, lse, scale, sink):
    """float64 (valid [B,S,K], clamped rows, gathered kv [B,S,K,D], P [B,S,H,K], normaliser [B,S,H])
    from the given lse (sink in the normaliser; P = 0 on invalid slots and rows with lse +inf)."""
    q, kv = q.double(), kv.double()
    B, S, H, D = q.shape
    Skv = kv.shape[1]
    valid = (indices >= 0) & (indices < Skv)
    idx = torch.where(valid, indices, torch.zeros_like(indices)).long()
    kvg = torch.gather(kv.unsqueeze(1).expand(B, S, Skv, D), 2, idx.unsqueeze(-1).expand(B, S, idx.shape[-1], D))
    s = torch.einsum("bshd,bskd->bshk", q, kvg) * scale
    lse = lse.double()
    norm = lse if sink is None else torch.logaddexp(lse, sink.double().view(1, 1, H))
    ok = valid.unsqueeze(2) & torch.isfinite(norm).unsqueeze(-1)
    p = torch.where(ok, torch.exp(s - torch.where(torch.isfinite(norm), norm, 0).unsqueeze(-1)), 0)
    return valid, idx, kvg, p, norm


def _given_inputs_grads(q, kv, indices, out, lse, dout, scale, sink, dv):
    """float64 gradients of the backward op for the inputs it is given: Delta from the given
    (rounded) out, P from the given lse. Where the exact gradient cancels to ~0 (one valid key,
    negligible sink), the bf16 rounding of out dominates every bf16 kernel's dq; this reference
    carries the same rounding, so the kernel is judged on its own arithmetic."""
    q, kv, out, dout = q.double(), kv.double(), out.double(), dout.double()
    B, S, H, D = q.shape
    Skv = kv.shape[1]
    valid, idx, kvg, p, norm = _given_p(q, kv, indices, lse, scale, sink)
    dp = torch.einsum("bshd,bskd->bshk", dout, kvg[..., :dv])
    delta = (out * dout).sum(-1)
    ds = p * (dp - delta.unsqueeze(-1))
    dq = scale * torch.einsum("bshk,bskd->bshd", ds, kvg)
    contrib = scale * torch.einsum("bshk,bshd->bskd", ds, q)
    contrib[..., :dv] += torch.einsum("bshk,bshd->bskd", p, dout)
    contrib = contrib * valid.unsqueeze(-1)
    rows = (idx + torch.arange(B, device=idx.device).view(B, 1, 1) * Skv).reshape(-1)
    dkv = torch.zeros(B * Skv, D, dtype=torch.float64, device=q.device)
    dkv.index_add_(0, rows, contrib.reshape(-1, D))
    dsink = None
    if sink is not None:
        psink = torch.where(torch.isfinite(norm), torch.exp(sink.double().view(1, 1, H) - norm), 0)
        dsink = -(delta * psink).sum((0, 1))
    return dq, dkv.view(B, Skv, D), dsink


def _err(a, ref_autograd, ref_given):
    """Norm-relative error against the autograd oracle, or against the same math on the given
    (rounded) inputs, whichever is smaller (they differ only where the exact gradient cancels)."""
    return min(_rel(a, ref_autograd), _rel(a, ref_given))


def _rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "kernel output has NaN/inf"
    den = b.norm().item()
    d = (a - b).norm().item()
    return d / den if den > 0 else d


def _make_indices(g, B, S, K, Skv, kind):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "valid":
        idx = torch.randint(0, Skv, (B, S, K), generator=g, device=dev)
    elif kind == "mixed":  # -1 padding, out of range on both sides, duplicates, empty rows
        idx = torch.randint(0, Skv, (B, S, K), generator=g, device=dev)
        r = torch.rand(B, S, K, generator=g, device=dev)
        idx = torch.where(r < 0.2, torch.full_like(idx, -1), idx)
        idx = torch.where((r >= 0.2) & (r < 0.25), idx + Skv, idx)
        idx = torch.where((r >= 0.25) & (r < 0.28), torch.full_like(idx, -9), idx)
        dup = torch.rand(B, S, K, generator=g, device=dev) < 0.1
        idx = torch.where(dup, idx[..., :1].expand_as(idx), idx)
        idx[:, S // 2] = -1
        if S > 2:
            idx[:, 0] = Skv + 3  # out of range only: no valid key either
    elif kind == "dups":  # many queries select the same few keys
        pool = torch.randint(0, Skv, (4,), generator=g, device=dev)
        idx = pool[torch.randint(0, 4, (B, S, K), generator=g, device=dev)]
    elif kind == "empty":  # most rows have no valid key
        idx = torch.full((B, S, K), -1, device=dev, dtype=torch.long)
        idx[:, ::3, :1] = torch.randint(0, Skv, (B, (S + 2) // 3, 1), generator=g, device=dev)
    else:
        raise ValueError(kind)
    return idx.to(torch.int32)


# (H, Dqk, Dv, has_sink, dtype): every shipped configuration plus small dims
CONFIGS = [
    (64, 512, 512, True, torch.bfloat16),
    (128, 512, 512, True, torch.bfloat16),
    (64, 576, 512, False, torch.bfloat16),
    (128, 576, 512, False, torch.bfloat16),
    (16, 576, 512, False, torch.bfloat16),
    (32, 512, 512, True, torch.bfloat16),
    (16, 64, 64, True, torch.bfloat16),
    (32, 128, 64, False, torch.bfloat16),
    (16, 64, 64, True, torch.float16),
]

# (B, S, Skv, K, index kind, sink kind)
CASES = [
    (1, 17, 200, 64, "valid", "normal"),
    (1, 33, 300, 77, "mixed", "large"),
    (2, 9, 64, 1, "mixed", "negative"),
    (2, 21, 50, 130, "mixed", "normal"),  # K > Skv
    (1, 40, 128, 100, "dups", "large"),
    (1, 15, 100, 40, "empty", "negative"),
]
BIG_CASES = [(1, 8, 3000, 2065, "mixed", "normal")]


def _params():
    out = []
    for ci, cfg in enumerate(CONFIGS):
        cases = CASES + (BIG_CASES if cfg[1] >= 512 else [])
        for case in cases:
            out.append(pytest.param(cfg, case, id=f"H{cfg[0]}-D{cfg[1]}-{cfg[2]}-{'sink' if cfg[3] else 'nosink'}-"
                                    f"{str(cfg[4])[6:]}-B{case[0]}S{case[1]}Skv{case[2]}K{case[3]}-{case[4]}-{case[5]}"))
    return out


def _inputs(cfg, case, seed):
    H, Dqk, Dv, has_sink, dtype = cfg
    B, S, Skv, K, ikind, skind = case
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    q = torch.randn(B, S, H, Dqk, generator=g, device="cuda").to(dtype)
    kv = torch.randn(B, Skv, Dqk, generator=g, device="cuda").to(dtype)
    dout = torch.randn(B, S, H, Dv, generator=g, device="cuda").to(dtype)
    idx = _make_indices(g, B, S, K, Skv, ikind)
    sink = None
    if has_sink:
        base = {"normal": 0.0, "large": 8.0, "negative": -30.0}[skind]
        sink = (base + torch.randn(H, generator=g, device="cuda")).float()
    scale = Dqk ** -0.5 * 1.3
    return q, kv, idx, dout, sink, scale


def _reference(q, kv, idx, dout, sink, scale, dv):
    q64 = q.double().requires_grad_(True)
    kv64 = kv.double().requires_grad_(True)
    s64 = sink.double().requires_grad_(True) if sink is not None else None
    out, lse = _ref_forward(q64, kv64, idx, scale, s64, dv)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, kv64.grad, (s64.grad if s64 is not None else None)


@pytest.mark.parametrize("cfg,case", _params())
def test_bwd_matches_float64_autograd(cfg, case):
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, _, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=zlib.crc32(repr((cfg[:4], case)).encode()) % 10_000)
    out64, lse64, dq_ref, dkv_ref, dsink_ref = _reference(q, kv, idx, dout, sink, scale, Dv)
    out = out64.to(dtype)
    lse = lse64.float()
    dq, dkv, dsink = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv)
    torch.cuda.synchronize()
    assert dq.shape == q.shape and dq.dtype == q.dtype
    assert dkv.shape == kv.shape and dkv.dtype == torch.float32
    g_dq, g_dkv, g_ds = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    e_dq, e_dkv = _err(dq, dq_ref, g_dq), _err(dkv, dkv_ref, g_dkv)
    msg = f"dq {e_dq:.2e} dkv {e_dkv:.2e} (vs autograd: dq {_rel(dq, dq_ref):.2e})"
    if has_sink:
        assert dsink is not None and dsink.shape == (H,) and dsink.dtype == torch.float32
        e_ds = _err(dsink, dsink_ref, g_ds)
        msg += f" dsink {e_ds:.2e}"
    else:
        assert dsink is None
        e_ds = 0.0
    print(msg)
    # rows without a valid slot: exactly zero dq
    empty = ~((idx >= 0) & (idx < kv.shape[1])).any(-1)
    if empty.any():
        assert (dq[empty] == 0).all()
    assert e_dq < TOL and e_dkv < TOL and e_ds < TOL, msg
    # deterministic mode agrees with the reference too
    dq2, dkv2, dsink2 = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True)
    e2 = (_err(dq2, dq_ref, g_dq), _err(dkv2, dkv_ref, g_dkv), _err(dsink2, dsink_ref, g_ds) if has_sink else 0.0)
    assert max(e2) < TOL, f"deterministic: {e2}"


@pytest.mark.parametrize("cfg,det_mode", [(CONFIGS[0], None), (CONFIGS[2], None), (CONFIGS[3], None), (CONFIGS[7], None),
                                          (CONFIGS[0], "fixed"), (CONFIGS[3], "fixed"), (CONFIGS[0], "contrib_ws"),
                                          (CONFIGS[3], "contrib_ws"), (CONFIGS[0], "contrib_bf16"),
                                          (CONFIGS[3], "contrib_bf16"), (CONFIGS[0], "contrib_i16"),
                                          (CONFIGS[3], "contrib_i16")],
                         ids=lambda c: c if isinstance(c, str) or c is None else f"H{c[0]}-D{c[1]}")
def test_deterministic_is_bitwise_reproducible(cfg, det_mode):
    """20 runs, the same bits: the contribution path (the default), and on the ws shapes the fixed-point
    sums and the contributions stored by the ws program."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    case = (2, 31, 96, 150, "dups", "normal")
    _, _, Dv, _, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=7)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    kw = dict(sink=sink, dv=Dv, deterministic=True, config={"det_mode": det_mode} if det_mode else None)
    first = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    for _ in range(19):
        again = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
        for a, b in zip(first, again):
            if a is None:
                assert b is None
            else:
                assert torch.equal(a, b)


def test_deterministic_chunking(monkeypatch):
    """A tiny contribution budget forces many query chunks; the result must not change."""
    from dsa_plugins.kernels import sparse_attention_bwd as mod

    cfg, case = CONFIGS[6], (2, 37, 80, 70, "mixed", "normal")
    _, Dqk, Dv, _, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=3)
    out64, lse64, _, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    full = mod.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True)
    monkeypatch.setattr(mod, "_DET_BUDGET_BYTES", 5 * 128 * Dqk * 4)
    chunked = mod.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True)
    assert torch.equal(full[0], chunked[0])
    assert _rel(chunked[1], dkv_ref) < TOL


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[3], CONFIGS[4], CONFIGS[7], CONFIGS[8]],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{c[2]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_bwd_emits_head_summed_probs(cfg, case, deterministic):
    """return_probs: the head sum of P per slot (the indexer loss target) matches float64 from the
    same lse, is exactly 0 on invalid slots, and the gradients are those of the plain program."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    if Dqk < 512 and case is BIG_CASES[0]:
        pytest.skip("the big case runs on the model dims")
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=zlib.crc32(repr((cfg[:4], case, 1)).encode()) % 10_000)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    plain = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=deterministic)
    dq, dkv, dsink, probs = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv,
                                                 deterministic=deterministic, return_probs=True)
    assert probs.shape == idx.shape and probs.dtype == torch.float32
    want = _given_p(q, kv, idx, lse, scale, sink)[3].sum(2)  # head sum per slot
    assert _rel(probs, want) < 2e-4, _rel(probs, want)  # fp32 scores from bf16 inputs, exp in fp32
    invalid = ~((idx >= 0) & (idx < kv.shape[1]))
    assert (probs[invalid] == 0).all()
    assert (probs >= 0).all()
    assert torch.equal(dq, plain[0])
    assert _rel(dkv, plain[1]) < 1e-6
    if deterministic:
        assert torch.equal(dkv, plain[1])
    if has_sink:
        assert torch.equal(dsink, plain[2])


def _causal_rows(g, B, S, K, Skv):
    """Row s names its first min(s + 1, K) keys (causal top-k: -1 after them), plus an empty row
    and a row with -1 inside its valid run (the last valid slot decides how far a row walks)."""
    dev = "cuda"
    idx = torch.randint(0, Skv, (B, S, K), generator=g, device=dev).int()
    width = torch.arange(S, device=dev).clamp(max=K - 1) + 1
    idx = torch.where(torch.arange(K, device=dev)[None, None, :] < width[None, :, None], idx, -1)
    idx[:, 1] = -1  # an empty row
    idx[:, -1, ::3] = -1  # holes, and the row still ends on a valid slot
    idx[:, -1, -1] = 0
    return idx


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3], CONFIGS[4]], ids=lambda c: f"H{c[0]}-D{c[1]}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("schedule", ["plain", "ws"])
def test_skip_tail_walks_only_to_the_last_valid_slot(cfg, deterministic, schedule):
    """skip_tail (each row stops after its last valid slot) changes nothing: dq and the head-summed
    probabilities bitwise, dkv bitwise in deterministic mode; and both match float64."""
    from dsa_plugins.common.indices import row_blocks
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    B, S, Skv, K = 2, 150, 400, 130  # K not a multiple of the block; rows of 1 .. K valid slots
    q, kv, _, dout, sink, scale = _inputs(cfg, (B, S, Skv, K, "valid", "normal"), seed=11)
    g = torch.Generator(device="cuda").manual_seed(12)
    idx = _causal_rows(g, B, S, K, Skv)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    blocks = row_blocks(torch.nn.functional.pad(idx[0], (0, 192 - K), value=-1), 64)
    assert blocks[0].item() == 1 and blocks[1].item() == 0 and blocks[-1].item() == 3
    kw = dict(sink=sink, dv=Dv, deterministic=deterministic, return_probs=True)
    plain = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, config={"schedule": schedule, "skip_tail": False},
                                 **kw)
    skip = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, config={"schedule": schedule, "skip_tail": True},
                                **kw)
    assert torch.equal(skip[0], plain[0]) and torch.equal(skip[3], plain[3])
    assert (skip[0][:, 1] == 0).all()  # the empty row
    if deterministic:
        assert torch.equal(skip[1], plain[1])
    assert _rel(skip[0], dq_ref) < TOL and _rel(skip[1], dkv_ref) < TOL


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[1] >= 512], ids=lambda c: f"H{c[0]}-D{c[1]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4]] + BIG_CASES + [(2, 150, 400, 130, "causal", "normal")],
                         ids=lambda c: f"B{c[0]}S{c[1]}K{c[3]}-{c[4]}")
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_ws_without_auto_sync_matches_with_it(cfg, case, deterministic):
    """ws_auto_sync False (the ws program without TileLang's automatic warpgroup syncs): dq bitwise, dkv
    bitwise in deterministic mode (fp32 reduction order otherwise), both match float64; run three times."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    B, S, Skv, K, kind, skind = case
    q, kv, idx, dout, sink, scale = _inputs(cfg, (B, S, Skv, K, "valid" if kind == "causal" else kind, skind), seed=21)
    if kind == "causal":
        idx = _causal_rows(torch.Generator(device="cuda").manual_seed(22), B, S, K, Skv)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, cfg[2])
    out, lse = out64.to(cfg[4]), lse64.float()
    kw = dict(sink=sink, dv=cfg[2], deterministic=deterministic)
    base = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, config={"ws_auto_sync": True}, **kw)
    for _ in range(3):
        res = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, config={"ws_auto_sync": False}, **kw)
        assert torch.equal(res[0], base[0])
        if deterministic:
            assert torch.equal(res[1], base[1])
        assert _rel(res[0], dq_ref) < TOL and _rel(res[1], dkv_ref) < TOL


@pytest.mark.parametrize("tuning", [{"stage_atomics": True}, {"stage_atomics": True, "l2_keep": True}],
                         ids=["staged", "staged-l2keep"])
def test_staged_reductions_match_the_default(tuning):
    """The staged v4 dkv reductions (with or without an L2 policy) give the plain program's gradients."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    # V4 512/512 (the staging buffer does not fit beside MLA's 576-wide tiles), K > Skv with -1 and
    # out-of-range slots
    cfg, case = CONFIGS[0], CASES[3]
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=21)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    plain = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, config={"schedule": "plain"})
    staged = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv,
                                  config={**tuning, "schedule": "plain"})
    assert torch.equal(staged[0], plain[0])
    assert _rel(staged[1], plain[1]) < 1e-5 and _rel(staged[1], dkv_ref) < TOL


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c[2] % 128 == 0], ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", CASES + BIG_CASES, ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_schedule_agrees_with_the_plain_program(cfg, case):
    """The warp-specialised program (the default of the atomic mode) and the plain one compute the
    same gradients: dq to rounding of the split accumulators, dkv to fp32 reduction order; both
    match float64, and no element is NaN."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=31)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    # the preprocess's Delta on both sides (ws_fused_pre's own test compares the fused one)
    ws = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv,
                              config={"schedule": "ws", "ws_fused_pre": False})
    plain = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, config={"schedule": "plain"})
    assert not ws[0].isnan().any() and not ws[1].isnan().any()
    assert _rel(ws[0], plain[0]) < 5e-3 and _rel(ws[1], plain[1]) < 1e-5
    # against float64 as the main test measures it (rows of one key have a dq of rounding size)
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    assert _err(ws[0], dq_ref, g_dq) < TOL and _err(ws[1], dkv_ref, g_dkv) < TOL


@pytest.mark.parametrize("tuning", [{"ws_prefetch": False}, {"ws_dq_rs": True}, {"l2_keep": True}],
                         ids=["no-prefetch", "dq-rs", "l2-keep"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_tuning_variants_match_float64(tuning, case):
    """The ws program's tuning variants compute the same gradients (MLA 576/512 H64; -1, out of
    range, duplicates, empty rows, K not a multiple of the block)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg = CONFIGS[2]
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=41)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    dq, dkv, _ = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, config=tuning)
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    assert _err(dq, dq_ref, g_dq) < TOL and _err(dkv, dkv_ref, g_dkv) < TOL
    empty = ~((idx >= 0) & (idx < kv.shape[1])).any(-1)
    assert (dq[empty] == 0).all()


@pytest.mark.parametrize("cfg", [(128, 512, 512, True, torch.bfloat16), (100, 512, 512, True, torch.bfloat16),
                                 (256, 512, 512, False, torch.bfloat16), (128, 512, 512, True, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], BIG_CASES[0]],
                         ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_pair_sums_head_blocks_in_a_cluster(cfg, case):
    """``ws_pair``: the two head blocks of a query row sum each dkv chunk in a 2-CTA cluster and reduce half
    of it each. The gradients match float64 and the unpaired program (dkv to fp32 reduction order, dq and
    the head-summed probabilities bitwise: the pair changes only how dkv is reduced), including padded
    heads in the second block (H 100), two pairs per row (H 256), many slots naming one kv row (dups),
    empty rows and K not a multiple of the block; never NaN."""
    from dsa_plugins.kernels.sparse_attention_bwd import _normalise_config, sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    assert _normalise_config({"heads": H, "dqk": Dqk, "dv": Dv, "ws_pair": True})["ws_pair"]
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=53)
    out64, lse64, dq_ref, dkv_ref, dsink_ref = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    pair = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_pair": True}, return_probs=True)
    solo = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_pair": False}, return_probs=True)
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    assert _err(pair[0], dq_ref, g_dq) < TOL and _err(pair[1], dkv_ref, g_dkv) < TOL
    assert torch.equal(pair[0], solo[0]) and torch.equal(pair[3], solo[3])
    assert _rel(pair[1], solo[1]) < 1e-5
    if sink is not None:
        assert torch.equal(pair[2], solo[2])
    empty = ~((idx >= 0) & (idx < kv.shape[1])).any(-1)
    assert (pair[0][empty] == 0).all()


@pytest.mark.parametrize("cfg", [CONFIGS[3], (100, 576, 512, False, torch.bfloat16), CONFIGS[0],
                                 (128, 512, 512, True, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[2], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_stage_dq_stores_the_fragments_bits(cfg, case):
    """``ws_stage_dq``: dq through shared memory in 16-byte stores holds the bits the fragments' own stores write
    (the same roundings, other addresses): padded heads (H 100: rows past H never written), fp16, batches of two,
    empty rows; both modes, the head-summed probabilities unchanged."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=73)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    for det in (False, True):
        # a given dq full of NaN: every element must be written
        dq_given = torch.full_like(q, float("nan"))
        staged = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                      config={"ws_stage_dq": True}, dq=dq_given)
        frags = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                     config={"ws_stage_dq": False})
        assert torch.equal(staged[0], frags[0]) and torch.equal(staged[3], frags[3]), det
        assert torch.equal(staged[1], frags[1]) if det else _rel(staged[1], frags[1]) < 1e-5
        g_dq, _, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
        assert _err(staged[0], dq_ref, g_dq) < TOL


@pytest.mark.parametrize("cfg", [CONFIGS[3], (100, 576, 512, False, torch.bfloat16), CONFIGS[0],
                                 (128, 512, 512, True, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[2], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_tma_dq_stores_the_staged_bits(cfg, case):
    """``ws_tma_dq``: the staged dq tiles stored by TMA hold the bits of the threads' 16-byte stores, both modes:
    padded heads (H 100: the rows past H fall outside the tensor), fp16, batches of two, empty rows, a given dq
    full of NaN (every element written), and given dq and dkv whose bases are off 16 bytes (written through
    aligned copies: TMA, the 16-byte stores and the v4 reductions need an aligned base)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=83)
    out64, lse64, dq_ref, _, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    g_dq, _, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    for det in (False, True):
        threads = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, config={"ws_tma_dq": False})
        given = torch.full_like(q, float("nan"))
        tma = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, config={"ws_tma_dq": True},
                                   dq=given)
        assert torch.equal(given, threads[0].reshape(given.shape)), det  # written in place, every element
        assert torch.equal(tma[1], threads[1]) if det else _rel(tma[1], threads[1]) < 1e-5
        assert _err(tma[0], dq_ref, g_dq) < TOL
        off = misaligned_view(torch.full_like(q, float("nan")))
        dkv_off = misaligned_view(torch.zeros(kv.shape, dtype=torch.float32, device=q.device))
        sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, config={"ws_tma_dq": True}, dq=off,
                             dkv=dkv_off)
        assert torch.equal(off, threads[0].reshape(off.shape)), det
        assert torch.equal(dkv_off, threads[1]) if det else _rel(dkv_off, threads[1]) < 1e-5, det


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("cfg", [CONFIGS[3], (100, 576, 512, False, torch.bfloat16), CONFIGS[0],
                                 (128, 512, 512, True, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_row_regs_gives_the_per_score_tests_bits(mode, cfg, case):
    """``ws_row_regs`` 1 and 2 (P from an exponent whose argument is -inf at invalid slots; dS formed for every
    slot and then zeroed there) hold the bits of the per-score slot test (0): padded heads
    (H 100), fp16, batches of two, duplicate slots, empty rows, both modes, the head-summed probabilities; and a
    query head whose scores are NaN leaves the same NaN and finite values in both (invalid slots stay exactly 0)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=79)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    g_dq, _, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    q_nan = q.clone()
    q_nan[0, 0, H // 2, 3] = float("nan")
    same = dict(rtol=0, atol=0, equal_nan=True)
    for qq in (q, q_nan):
        args = (qq, kv, idx, out, lse, dout, scale)
        for det in (False, True):
            new = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                       config={"ws_row_regs": mode})
            old = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                       config={"ws_row_regs": 0})
            torch.testing.assert_close(new[0], old[0], **same)
            torch.testing.assert_close(new[3], old[3], **same)
            if det:
                torch.testing.assert_close(new[1], old[1], **same)
            else:
                assert torch.equal(new[1].isnan(), old[1].isnan())
                fin = new[1].isfinite()
                assert _rel(new[1][fin], old[1][fin]) < 1e-5
            if qq is q:
                assert _err(new[0], dq_ref, g_dq) < TOL and not new[1].isnan().any()
            elif ((idx[0, 0] >= 0) & (idx[0, 0] < kv.shape[1])).any():
                assert new[0][0, 0].isnan().any()  # the NaN reached the row's gradients


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[4], (100, 512, 512, True, torch.bfloat16), CONFIGS[0], CONFIGS[1],
                                 (128, 576, 512, False, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_tma_q_matches_the_threads_copies(cfg, case):
    """``ws_tma_q`` (the default): q and dout by TMA (heads past H outside the tensor: zeros, as the threads'
    copies write them). dq and the head-summed probabilities bitwise those of the threads' copies, dkv up to the
    reduction order, both modes; padded heads (H 16, 100), fp16, batches of two, empty rows, and q / dout views
    that start off a 16-byte boundary (the wrapper copies them: a TMA tensor's base must be aligned)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=71)
    if case is CASES[1]:  # the same values in views one element past an aligned base
        q, dout = misaligned_view(q), misaligned_view(dout)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    for det in (False, True):
        tma = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                   config={"ws_tma_q": True})
        thr = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                   config={"ws_tma_q": False})
        assert torch.equal(tma[0], thr[0]) and torch.equal(tma[3], thr[3])
        assert torch.equal(tma[1], thr[1]) if det else _rel(tma[1], thr[1]) < 1e-5
        g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
        assert _err(tma[0], dq_ref, g_dq) < TOL and _err(tma[1], dkv_ref, g_dkv) < TOL


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[4], (100, 512, 512, True, torch.bfloat16), CONFIGS[0], CONFIGS[1],
                                 (128, 576, 512, False, torch.float16), (20, 512, 512, False, torch.bfloat16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{'sink' if c[3] else 'nosink'}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[4], CASES[5], BIG_CASES[0],
                                  (2, 150, 400, 130, "causal", "normal")],
                         ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}-{c[5]}")
def test_ws_fused_pre_matches_the_preprocess(cfg, case):
    """``ws_fused_pre`` (the ws program's default): lse' and Delta formed inside the program, not by the
    preprocess. Delta is summed in another order, so dq and dkv agree with the preprocess's to rounding (a dS
    may round to the next bf16): as close to float64 as they are; dsink within fp32 rounding; the atomic, deterministic
    and head-summed-P programs; padded heads (H 20, 100), fp16, empty rows (Delta 0 whatever dout holds), rows
    whose slots are all invalid (a walk of no block), misaligned out / kv views, with and without the sink."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    if case[4] == "causal":
        q, kv, _, dout, sink, scale = _inputs(cfg, (2, 150, 400, 130, "valid", "normal"), seed=83)
        idx = _causal_rows(torch.Generator(device="cuda").manual_seed(84), 2, 150, 130, 400)
    else:
        q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=83)
    out64, lse64, dq_ref, dkv_ref, dsink_ref = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    if case is CASES[1]:  # out and kv as views one element past an aligned base (the wrapper copies them)
        out, kv = misaligned_view(out), misaligned_view(kv)
    empty = ~((idx >= 0) & (idx < kv.shape[1])).any(-1)
    dout = dout.clone()
    dout[empty] = float("nan")  # an empty row's Delta is 0 whatever dout holds
    args = (q, kv, idx, out, lse, dout, scale)
    g_dq, g_dkv, g_dsink = _given_inputs_grads(*args[:5], dout.nan_to_num(0.0), scale, sink, Dv)
    for det in (False, True):
        fused = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                     config={"ws_fused_pre": True})
        pre = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=det, return_probs=True,
                                   config={"ws_fused_pre": False})
        for a, b in zip(fused, pre):
            if a is not None:
                assert not a.isnan().any()
        assert torch.equal(fused[3], pre[3])  # P does not read Delta
        # as close to float64 as the preprocess's (where dq cancels to rounding size, e.g. one valid key and a
        # negligible sink, the two differ relatively by 10-20%: each is rounding noise)
        for got, ref, given, base in ((fused[0], dq_ref, g_dq, pre[0]), (fused[1], dkv_ref, g_dkv, pre[1])):
            err = _err(got, ref, given)
            assert err < TOL and err <= 1.5 * _err(base, ref, given) + 1e-3
        assert (fused[0][empty] == 0).all()
        if sink is not None:
            assert _rel(fused[2], pre[2]) < 1e-5 and _err(fused[2], dsink_ref, g_dsink) < TOL
        if det:  # bitwise reproducible
            again = sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=True, config={"ws_fused_pre": True})
            assert all(torch.equal(a, b) for a, b in zip(again, fused[:3]) if a is not None)


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[4], (100, 512, 512, True, torch.bfloat16), CONFIGS[0], CONFIGS[1],
                                 (128, 576, 512, False, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_dkv_perm_adds_into_permuted_columns_and_restores_them(cfg, case):
    """``ws_dkv_perm``: the atomic ws program adds into dkv with its columns permuted within groups of 16 (one register
    exchange per reduction) and the wrapper restores their order: dq and the head-summed P bitwise the default's, dkv
    to fp32 reduction order and against float64, also when dkv is given holding values (it is added to); the
    deterministic programs store their rows so (no exchange) and the reduce restores the order."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=97)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    perm = sparse_attention_bwd(*args, sink=sink, dv=Dv, return_probs=True, config={"ws_dkv_perm": True})
    base = sparse_attention_bwd(*args, sink=sink, dv=Dv, return_probs=True, config={"ws_dkv_perm": False})
    assert torch.equal(perm[0], base[0]) and torch.equal(perm[3], base[3])
    assert _rel(perm[1], base[1]) < 1e-5
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    assert _err(perm[1], dkv_ref, g_dkv) < TOL
    start = 0.01 * torch.randn(kv.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(98))
    acc = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_dkv_perm": True}, dkv=start.clone())
    assert _rel(acc[1] - start, base[1]) < 1e-5
    # a dkv of ours in the inputs' dtype (the ops layer's call): restored and cast in one pass, or cast alone; fp32
    # atomics' order moves a rounding boundary for a rare element only
    for p in (True, False):
        cast = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_dkv_perm": p}, dkv_dtype=dtype)
        assert cast[1].dtype == dtype and cast[1].is_contiguous() and torch.equal(cast[0], base[0])
        assert (cast[1] != base[1].to(dtype)).float().mean() < 1e-3, p
        assert _err(cast[1].float(), dkv_ref, g_dkv) < TOL
    # the deterministic rows stored with permuted columns (no register exchange), put back in order by the reduce:
    # fp32 and bf16 rows hold the same values summed in the same order (bitwise); int16 blocks group other values
    for mode in ("contrib_ws", "contrib_bf16", "contrib_i16"):
        det = [sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=True,
                                    config={"ws_dkv_perm": p, "det_mode": mode}) for p in (False, True, True)]
        assert torch.equal(det[0][0], det[1][0]) and torch.equal(det[1][1], det[2][1]), mode
        if mode == "contrib_i16":
            assert _rel(det[1][1], det[0][1]) < 1e-4 and _err(det[1][1], dkv_ref, g_dkv) < TOL
        else:
            assert torch.equal(det[0][1], det[1][1]), mode


def _det_runs_of(cfg, case, seed, det_mode, key):
    """The deterministic backward (``det_mode``, return_probs) of ``cfg`` on ``case`` as a function of config ``key``
    (on / off): (run, the arguments of ``_given_inputs_grads``, float64 dq and dkv)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    Dv, dtype = cfg[2], cfg[4]
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=seed)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    args = (q, kv, idx, out64.to(dtype), lse64.float(), dout, scale)

    def run(on):
        return sparse_attention_bwd(*args, sink=sink, dv=Dv, deterministic=True, return_probs=True,
                                    config={"det_mode": det_mode, key: on})

    return run, (*args, sink, Dv), dq_ref, dkv_ref


def _assert_reruns_give_the_same_bits(run, first, times=3):
    """``run(True)`` again ``times`` times: dq and dkv bit for bit ``first``'s."""
    for _ in range(times):
        again = run(True)
        assert torch.equal(again[1], first[1]) and torch.equal(again[0], first[0])


# shapes where the head blocks pair (dqk == dv, an even number of blocks): padded heads, two pairs a row, fp16
PAIR_CONFIGS = [CONFIGS[1], (100, 512, 512, True, torch.bfloat16), (256, 512, 512, False, torch.bfloat16),
                (128, 512, 512, True, torch.float16)]


@pytest.mark.parametrize("det_mode", ["contrib_i16", "contrib_bf16", "contrib_ws"])
@pytest.mark.parametrize("cfg", PAIR_CONFIGS, ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[4], CASES[5], BIG_CASES[0]],
                         ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_det_pair_stores_one_contribution_row_per_head_block_pair(det_mode, cfg, case):
    """``det_pair`` (the default where ws_pair can run): the two head blocks of a query row sum each dkv chunk in a
    2-CTA cluster and store one contribution row per slot of the pair. Bitwise reproducible; dq and the head-summed
    probabilities bitwise those of the unpaired deterministic program; dkv within the float64 tolerance and close
    to the unpaired sums (int16 blocks of 4 values instead of 8 where det_pair_perm is off); padded heads (H 100),
    two pairs per row (H 256), dups, -1, out of range, empty rows, K not a multiple of the block; never NaN."""
    from dsa_plugins.kernels.sparse_attention_bwd import _normalise_config

    H, Dqk, Dv, has_sink, dtype = cfg
    assert _normalise_config({"heads": H, "dqk": Dqk, "dv": Dv})["det_pair"]
    run, given, dq_ref, dkv_ref = _det_runs_of(cfg, case, 61, det_mode, "det_pair")
    pair, solo = run(True), run(False)
    assert not pair[1].isnan().any()
    g_dq, g_dkv, _ = _given_inputs_grads(*given)
    assert _err(pair[0], dq_ref, g_dq) < TOL and _err(pair[1], dkv_ref, g_dkv) < TOL
    assert torch.equal(pair[0], solo[0]) and torch.equal(pair[3], solo[3])
    assert _rel(pair[1], solo[1]) < (3e-3 if det_mode == "contrib_bf16" else 1e-4)
    _assert_reruns_give_the_same_bits(run, pair)


@pytest.mark.parametrize("det_mode", ["contrib_i16", "contrib_bf16", "contrib_ws"])
@pytest.mark.parametrize("cfg", PAIR_CONFIGS, ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_det_pair_perm_stores_the_pairs_rows_in_the_permuted_layout(det_mode, cfg, case):
    """``det_pair_perm`` (the default where the pair runs): the pair's contribution rows in the unpaired rows'
    permuted layout. dq and the head-summed probabilities bitwise those of the paired program in its real column
    order; dkv too for bf16 and
    fp32 rows (the same values summed in the same order), and for int16 rows within 1e-4 of it (blocks of 8 values
    instead of 4) and within the float64 tolerance; bitwise reproducible; never NaN."""
    from dsa_plugins.kernels.sparse_attention_bwd import _normalise_config

    H, Dqk, Dv, has_sink, dtype = cfg
    assert _normalise_config({"heads": H, "dqk": Dqk, "dv": Dv})["det_pair_perm"]
    run, given, _, dkv_ref = _det_runs_of(cfg, case, 67, det_mode, "det_pair_perm")
    perm, real = run(True), run(False)
    assert not perm[1].isnan().any()
    assert torch.equal(perm[0], real[0]) and torch.equal(perm[3], real[3])
    if det_mode == "contrib_i16":
        g_dq, g_dkv, _ = _given_inputs_grads(*given)
        assert _rel(perm[1], real[1]) < 1e-4 and _err(perm[1], dkv_ref, g_dkv) < TOL
    else:
        assert torch.equal(perm[1], real[1])
    _assert_reruns_give_the_same_bits(run, perm)


@pytest.mark.parametrize("det_mode", ["contrib_i16", "contrib_ws"])
@pytest.mark.parametrize("case", [CASES[4], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_det_pair_stores_the_same_bits_without_predicated_stores(det_mode, case):
    """The pair's half tiles stored with a branch around each store (``det_store_pred`` False) instead of the
    predicate inside the asm: the same dkv bits, and a NaN in dout still reaches exactly the kv rows it reaches
    in the atomic mode (that path stores zeros for a block that is not finite)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg = CONFIGS[1]
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=73)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()

    def run(d, pred):
        return sparse_attention_bwd(q, kv, idx, out, lse, d, scale, sink=sink, dv=Dv, deterministic=True,
                                    config={"det_mode": det_mode, "det_store_pred": pred})

    a, b = run(dout, True), run(dout, False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    if case is CASES[5]:
        return
    bad = dout.clone()
    bad[0, 3, 0, 5] = float("nan")
    atomic = sparse_attention_bwd(q, kv, idx, out, lse, bad, scale, sink=sink, dv=Dv)[1]
    nan_rows = torch.isnan(atomic[0]).any(-1)
    for pred in (True, False):
        dkv = run(bad, pred)[1]
        assert nan_rows.any() and torch.equal(torch.isnan(dkv[0]).any(-1), nan_rows)
        assert torch.isfinite(dkv[0, ~nan_rows]).all()


def test_det_pair_chunks_and_nan():
    """The paired contribution rows over many query chunks give the same dq bits and dkv up to the order of the
    chunks' sums, and a NaN in dout reaches the kv rows its query selected (as in the atomic mode), every other
    row finite."""
    from dsa_plugins.kernels import sparse_attention_bwd as mod

    cfg, case = CONFIGS[1], (2, 37, 80, 70, "mixed", "normal")
    _, Dqk, Dv, _, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=67)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse)
    full = mod.sparse_attention_bwd(*args, dout, scale, sink=sink, dv=Dv, deterministic=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "_DET_BUDGET_BYTES", 5 * 128 * Dqk * 4)
        chunked = mod.sparse_attention_bwd(*args, dout, scale, sink=sink, dv=Dv, deterministic=True)
    assert torch.equal(full[0], chunked[0]) and _rel(chunked[1], full[1]) < 1e-6
    dout = dout.clone()
    dout[0, 3, 0, 5] = float("nan")
    dkv = mod.sparse_attention_bwd(*args, dout, scale, sink=sink, dv=Dv, deterministic=True)[1]
    atomic = mod.sparse_attention_bwd(*args, dout, scale, sink=sink, dv=Dv)[1]
    nan_rows = torch.isnan(atomic[0]).any(-1)
    assert nan_rows.any() and torch.equal(torch.isnan(dkv[0]).any(-1), nan_rows)
    assert torch.isfinite(dkv[0, ~nan_rows]).all() and torch.isfinite(dkv[1]).all()


@pytest.mark.parametrize("n0", [1, 2, 3])
@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[1], (100, 576, 512, False, torch.bfloat16),
                                 (64, 512, 512, True, torch.float16)],
                         ids=lambda c: f"H{c[0]}-D{c[1]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_ws_wg0_chunks_split_the_dkv_chunks_between_warpgroups(n0, cfg, case):
    """``ws_wg0_chunks``: warpgroup 0 forms and reduces the last n0 dkv chunks (the K-only tail of the 576-wide
    layout among them). Only who sends which chunk changes: dq and the head-summed probabilities are bitwise
    those of n0 = 0, dkv equal up to fp32 reduction order in the atomic mode and bitwise in the deterministic
    one; the gradients match float64 with -1, out of range, dups, empty rows, padded heads, K not a multiple of
    the block, fp16."""
    from dsa_plugins.kernels.sparse_attention_bwd import _normalise_config, sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    assert _normalise_config({"heads": H, "dqk": Dqk, "dv": Dv, "ws_wg0_chunks": n0})["ws_wg0_chunks"] == n0
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=59)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    args = (q, kv, idx, out, lse, dout, scale)
    split = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_wg0_chunks": n0}, return_probs=True)
    base = sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_wg0_chunks": 0}, return_probs=True)
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    assert not split[1].isnan().any()
    assert _err(split[0], dq_ref, g_dq) < TOL and _err(split[1], dkv_ref, g_dkv) < TOL
    assert torch.equal(split[0], base[0]) and torch.equal(split[3], base[3])
    assert _rel(split[1], base[1]) < 1e-5
    det = [sparse_attention_bwd(*args, sink=sink, dv=Dv, config={"ws_wg0_chunks": n, "det_mode": "contrib_i16"},
                                deterministic=True)[1] for n in (n0, 0)]
    assert torch.equal(det[0], det[1])


@pytest.mark.parametrize("det_mode", ["contrib", "contrib_ws", "contrib_bf16", "contrib_i16"])
def test_deterministic_chunks_with_probs_and_two_head_blocks(monkeypatch, det_mode):
    """H 128 (two head blocks): the deterministic query chunks write the head-summed probabilities
    through a buffer of their own (a [2, T, K] slice is not contiguous); same bits as one chunk."""
    from dsa_plugins.kernels import sparse_attention_bwd as mod

    cfg, case = CONFIGS[3], (1, 9, 300, 130, "mixed", "normal")
    _, Dqk, Dv, _, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=5)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    # the query chunks belong to the contribution path (the fixed-point one needs none)
    kw = dict(sink=sink, dv=Dv, deterministic=True, return_probs=True, config={"det_mode": det_mode})
    whole = mod.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    monkeypatch.setattr(mod, "_DET_BUDGET_BYTES", 2 * 2 * 192 * Dqk * 4)  # 2 query rows per chunk (fp32), ~4 (16-bit)
    chunked = mod.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[3], whole[3])
    assert _rel(chunked[1], whole[1]) < 1e-6


@pytest.mark.parametrize("cfg", [CONFIGS[1], CONFIGS[2]], ids=lambda c: f"H{c[0]}-D{c[1]}")
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[5], BIG_CASES[0]], ids=lambda c: f"S{c[1]}K{c[3]}-{c[4]}")
def test_deterministic_modes_agree_with_float64(cfg, case):
    """The fixed-point sums and the contribution paths all match float64; the two contribution paths
    agree to fp32 rounding, and the ws one gives the atomic mode's dq bits."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=zlib.crc32(repr((cfg[:4], case, 2)).encode()) % 10_000)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    res = {m: sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True,
                                   config={"det_mode": m})
           for m in ("fixed", "contrib", "contrib_ws", "contrib_bf16", "contrib_i16")}
    atomic = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv)
    for m, (dq, dkv, _) in res.items():
        assert not torch.isnan(dkv).any(), m
        assert _err(dq, dq_ref, g_dq) < TOL and _err(dkv, dkv_ref, g_dkv) < TOL, m
    # fixed-point sums round each value to a step far below fp32's: as close to the float64 sums as fp32 atomics
    assert _rel(res["fixed"][1], g_dkv) <= 2 * _rel(atomic[1], g_dkv) + 1e-6
    # dq: the ws program ("fixed" keeps the preprocess, whose Delta is summed in another order than ws_fused_pre's)
    atomic_pre = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv,
                                      config={"ws_fused_pre": False})
    assert torch.equal(res["fixed"][0], atomic_pre[0]) and torch.equal(res["contrib_ws"][0], atomic[0])
    assert _rel(res["contrib_ws"][1], res["contrib"][1]) < 1e-5
    # contributions rounded before the fp32 sum: bf16 (2^-9 of each value: the error of a bf16 dkv) and int16
    # with a power of two per 8 values (a step of 2^-14..2^-13 of the block's largest value); the atomic mode's own
    # error (bf16 P and dS in the MMAs: ~1.7e-3 here) is the yardstick
    e_bf16, e_i16, e_atomic = (_rel(r[1], g_dkv) for r in (res["contrib_bf16"], res["contrib_i16"], atomic))
    assert e_bf16 <= 1.6 * e_atomic + 2e-3 and e_i16 <= 1.05 * e_atomic + 1e-4, (e_bf16, e_i16, e_atomic)
    assert torch.equal(res["contrib_bf16"][0], atomic[0]) and torch.equal(res["contrib_i16"][0], atomic[0])


@pytest.mark.parametrize("det_mode", ["fixed", "contrib_i16"])
@pytest.mark.parametrize("factor", [1e-6, 1e4], ids=["tiny", "huge"])
def test_fixed_point_sums_follow_the_scale_of_the_gradients(factor, det_mode):
    """The fixed-point scale comes from the inputs' magnitudes: gradients 1e-6 or 1e4 times the usual keep
    their relative accuracy (no values lost under the step, no sum wrapped past int64); so do the int16
    contributions, whose power of two follows each block's values."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg, case = CONFIGS[3], (1, 33, 300, 77, "dups", "normal")
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=21)
    dout = (dout.float() * factor).to(dtype)
    out64, lse64, dq_ref, dkv_ref, _ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    g_dq, g_dkv, _ = _given_inputs_grads(q, kv, idx, out, lse, dout, scale, sink, Dv)
    dq, dkv, _ = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True,
                                      config={"det_mode": det_mode})
    assert not torch.isnan(dkv).any()
    assert _err(dq, dq_ref, g_dq) < TOL and _err(dkv, dkv_ref, g_dkv) < TOL


@pytest.mark.parametrize("det_mode", ["contrib_bf16", "contrib_i16"])
def test_rounded_contributions_carry_nan_to_the_rows_it_reaches(det_mode):
    """A NaN in dout reaches the kv rows its query selected, as in the atomic mode: the int16 blocks mark a
    block with a value that is not finite by a NaN scale (never a silent zero or a finite number)."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg, case = CONFIGS[2], (1, 17, 200, 64, "valid", "normal")
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=9)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    dout = dout.clone()
    dout[0, 3, 0, 5] = float("nan")
    dkv = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True,
                               config={"det_mode": det_mode})[1]
    atomic = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv)[1]
    nan_rows = torch.isnan(atomic[0]).any(-1)
    assert nan_rows.any() and torch.equal(torch.isnan(dkv[0]).any(-1), nan_rows)
    assert torch.isfinite(dkv[0, ~nan_rows]).all()


def test_fixed_point_flags_values_beyond_its_bound_as_nan():
    """An lse far below the scores' (P up to e^40: not the forward's lse) breaks the bound the scale was
    chosen for: those dkv elements come back NaN, never a wrapped integer; the atomic mode adds them."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg, case = CONFIGS[2], (1, 17, 200, 64, "valid", "normal")
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=4)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float() - 40.0
    dq, dkv, _ = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv, deterministic=True,
                                      config={"det_mode": "fixed"})
    atomic = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=sink, dv=Dv)
    assert torch.isfinite(atomic[1]).all()
    selected = torch.zeros(kv.shape[1], dtype=torch.bool, device=kv.device)
    selected[idx[(idx >= 0) & (idx < kv.shape[1])].long()] = True
    assert torch.isnan(dkv[0, selected]).any() and not torch.isnan(dkv[0, ~selected]).any()


@pytest.mark.parametrize("heads,dqk", [(64, 576), (20, 512)], ids=["H64-D576", "H20-D512"])
def test_fixed_point_preprocess_maxima_leave_out_non_finite_entries(heads, dqk):
    """The "fixed" mode's preprocess: the max of |q|, |out|, |dout| over the finite entries (inf and NaN
    left out, padded heads give 0), so one bad row cannot blow the scale up for every other one."""
    from dsa_plugins.kernels import sparse_attention_bwd as bwd

    g = torch.Generator(device="cuda").manual_seed(3)
    T_, dv = 37, 512
    q, o, do = (torch.randn(T_, heads, d, generator=g, device="cuda").bfloat16() for d in (dqk, dv, dv))
    q[5, heads - 1, dqk - 1] = 40.0  # the largest |q| sits in the last head's rope column
    o[0, 0, 0], do[1, 2, 3], q[2, 0, 7] = float("nan"), float("inf"), float("-inf")
    cfg = bwd._normalise_config({"heads": heads, "dqk": dqk, "dv": dv})
    pre = bwd._get("preprocess", bwd.runtime_target(q.device), *bwd._preprocess_args(cfg, True))
    lse = torch.zeros(T_, heads, device="cuda")
    delta, lse2 = torch.empty_like(lse), torch.empty_like(lse)
    maxima = torch.full((T_, (heads + 15) // 16, 128, 3), -1.0, device="cuda")
    pre(o, do, lse, torch.zeros(heads, device="cuda"), delta, lse2, q, maxima)
    got = maxima.view(-1, 3).amax(0)
    want = torch.stack([t.float().abs().nan_to_num(0, 0, 0).amax() for t in (q, o, do)])
    assert torch.equal(got, want) and got[0].item() == 40.0
    assert (maxima >= 0).all()  # every thread wrote its entry


@pytest.mark.parametrize("det_mode", ["contrib", "contrib_i16"])
def test_deterministic_backward_replays_under_a_cuda_graph(det_mode):
    """The contribution modes fork the slot sort onto a side stream and join it before the reduce: captured
    in a CUDA graph (as torch.compile's reduce-overhead mode does) and replayed, they give the eager bits."""
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    cfg, case = CONFIGS[0], (1, 33, 300, 77, "dups", "normal")
    H, Dqk, Dv, has_sink, dtype = cfg
    q, kv, idx, dout, sink, scale = _inputs(cfg, case, seed=13)
    out64, lse64, *_ = _reference(q, kv, idx, dout, sink, scale, Dv)
    out, lse = out64.to(dtype), lse64.float()
    kw = dict(sink=sink, dv=Dv, deterministic=True, config={"det_mode": det_mode})
    eager = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, allocator pools)
        sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, **kw)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured):
        assert (a is None and b is None) or torch.equal(a, b)
