"""GPU tests of the TileLang sparse indexer KL loss (forward rows and backward), against the float64
torch oracle ``dsa_plugins.reference.indexer_loss.indexer_kl_loss_reference``.

Every case draws fresh random inputs with awkward indices (-1, negative and >= Tk entries,
duplicates, rows without a valid slot), k not a multiple of 64 and odd T. Per-row losses come from
one oracle call per row; gradients from the oracle's backward of sum_t g_t * loss_t with random g.
NaN or inf anywhere fails (rel_err returns inf). Timings: benchmarks/kernels/bench_indexer_loss.py.
"""

import math
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9:
    pytestmark.append(pytest.mark.skip(reason="TileLang kernels need Hopper"))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from dsa_plugins.kernels import indexer_loss as K
from dsa_plugins.kernels.contrib_reduce import build_reduce
from dsa_plugins.reference.indexer_loss import indexer_kl_loss_reference
from tests.helpers import random_indices, rel_err

# (T, k, Tk, H, Hi, Dqk, lse given, sink)
CASES = [
    (37, 100, 300, 64, 64, 576, True, False),
    (33, 130, 257, 16, 32, 576, False, False),
    (29, 64, 100, 128, 64, 576, False, True),
    (31, 200, 1000, 128, 32, 576, True, True),
    (17, 2048, 4000, 64, 64, 576, True, False),
    (23, 150, 400, 64, 64, 512, True, True),
    (5, 70, 3, 32, 64, 576, False, False),  # Tk < k: mostly duplicates and invalid slots
]


def _ids(c):
    return f"T{c[0]}-k{c[1]}-Tk{c[2]}-H{c[3]}-Hi{c[4]}-D{c[5]}-lse{int(c[6])}-sink{int(c[7])}"


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile the programs the cases need in parallel (nvcc runs in subprocesses)."""
    if not torch.cuda.is_available():
        return
    target = K._device_target(torch.device("cuda"))
    cfgs = [{"kind": "attn_probs", "dim": d, "lse_pass": lp} for d, lp in {(c[5], not c[6]) for c in CASES}]
    dims = {128} | {c[4] for c in FROM_PROBS_CASES}
    cfgs += [{"kind": "loss", "heads": 64, "dim": di, "grads": g, "det": det, "lse_given": lg}
             for di in dims for g, det, lg in ((True, False, False), (False, False, False), (True, True, False),
                                               (True, False, True), (True, True, True))]
    with ThreadPoolExecutor(len(cfgs) + len(dims)) as ex:
        done = [ex.submit(K.build_config, c, target) for c in cfgs]
        done += [ex.submit(build_reduce, di, 1, "float32", target=target) for di in dims]
        for f in done:
            f.result()


def make_inputs(t, k, tk, h, hi, dqk, lse_given, with_sink, gen, di=128, device="cuda"):
    bf = torch.bfloat16
    q = torch.randn(t, h, dqk, generator=gen).to(bf)
    kv = torch.randn(tk, dqk, generator=gen).to(bf)
    iq = torch.randn(t, hi, di, generator=gen).to(bf)
    ik = torch.randn(tk, di, generator=gen).to(bf)
    w = torch.randn(t, hi, generator=gen) * (hi ** -0.5) * (di ** -0.5) * 4.0
    idx = random_indices(1, t, k, tk, generator=gen, empty_rows=2)[0]
    scale = dqk ** -0.5
    sink = torch.randn(h, generator=gen) if with_sink else None
    lse = None
    if lse_given:
        # the attention's lse over the selected slots (+inf for empty rows), perturbed per head so
        # that the given normaliser (not a recomputed one) is what the kernel must use
        valid = (idx >= 0) & (idx < tk)
        rows = kv.double()[idx.long().clamp(0, tk - 1)]  # [t, k, d]
        s = torch.einsum("thd,tkd->thk", q.double(), rows) * scale
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(s, -1)
        lse = torch.where(valid.any(-1, keepdim=True), lse + 0.3 * torch.randn(t, h, generator=gen, dtype=torch.float64),
                          torch.full_like(lse, math.inf)).float()
    out = {"index_q": iq, "index_k": ik, "weights": w, "q": q, "kv": kv, "attn_lse": lse, "topk_indices": idx,
           "scale": scale, "sink": sink}
    return {n: (v.to(device) if isinstance(v, torch.Tensor) else v) for n, v in out.items()}


def oracle(inp, g):
    """float64 per-row losses and the gradients of sum_t g_t * loss_t (one oracle call per row)."""
    iq = inp["index_q"].double().requires_grad_()
    ik = inp["index_k"].double().requires_grad_()
    w = inp["weights"].double().requires_grad_()
    q, kv = inp["q"].double(), inp["kv"].double()
    lse = None if inp["attn_lse"] is None else inp["attn_lse"].double()
    sink = None if inp["sink"] is None else inp["sink"].double()
    tk = kv.shape[0]
    idx = inp["topk_indices"].long()
    idx = torch.where(idx < tk, idx, -1)  # out of range = no key (what the public op does)
    rows, total = [], 0
    for t in range(iq.shape[0]):
        r = indexer_kl_loss_reference(
            iq[t:t + 1], ik, w[t:t + 1], q[t:t + 1], kv, None if lse is None else lse[t:t + 1],
            inp["scale"], topk_indices=idx[t:t + 1], sink=sink)
        rows.append(r.detach())
        total = total + r * g[t].double()
    total.backward()
    return torch.stack(rows), iq.grad, ik.grad, w.grad


def _finite(name, x):
    assert torch.isfinite(x).all(), f"{name} has {int((~torch.isfinite(x)).sum())} non-finite entries"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_loss_and_grads_match_oracle(case):
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) % (2**31))
    inp = make_inputs(*case, gen)
    t = case[0]
    g = (torch.rand(t, generator=gen) + 0.5).cuda() / t
    loss, (d_iq, d_ik, d_w) = K.indexer_kl_loss_sparse(**inp, grad_rows=g)
    value_only, none = K.indexer_kl_loss_sparse(**inp)
    torch.cuda.synchronize()
    assert none is None and torch.equal(value_only, loss)  # the value-only program: same pass 1
    assert loss.shape == (t,) and loss.dtype == torch.float32
    assert d_iq.shape == inp["index_q"].shape and d_iq.dtype == torch.bfloat16
    assert d_ik.shape == inp["index_k"].shape and d_ik.dtype == torch.float32
    assert d_w.shape == inp["weights"].shape and d_w.dtype == torch.float32
    for name, x in (("loss", loss), ("d_index_q", d_iq), ("d_index_k", d_ik), ("d_weights", d_w)):
        _finite(name, x)

    ref_rows, ref_iq, ref_ik, ref_w = oracle(inp, g)
    # rows without a valid slot: exactly 0 loss and 0 gradients
    idx = inp["topk_indices"]
    empty = ~((idx >= 0) & (idx < case[2])).any(1)
    assert bool(empty.any())
    assert bool((loss[empty] == 0).all())
    assert bool((d_iq[empty] == 0).all()) and bool((d_w[empty] == 0).all())

    err_loss = (loss.double() - ref_rows).abs().max().item()
    assert err_loss <= 2e-4 * max(1.0, ref_rows.abs().max().item()), f"loss rows: max abs err {err_loss:.3e}"
    assert rel_err(d_w, ref_w) < 2e-3, f"d_weights rel err {rel_err(d_w, ref_w):.3e}"
    assert rel_err(d_iq, ref_iq) < 2e-2, f"d_index_q rel err {rel_err(d_iq, ref_iq):.3e}"
    assert rel_err(d_ik, ref_ik) < 2e-2, f"d_index_k rel err {rel_err(d_ik, ref_ik):.3e}"


def test_all_rows_empty_and_no_keys():
    gen = torch.Generator().manual_seed(7)
    inp = make_inputs(9, 70, 50, 64, 64, 576, False, True, gen)
    inp["topk_indices"] = torch.where(inp["topk_indices"] >= 0, -1, inp["topk_indices"])  # all invalid
    loss, grads = K.indexer_kl_loss_sparse(**inp, grad_rows=torch.ones(9, device="cuda"))
    assert bool((loss == 0).all()) and all(bool((x == 0).all()) for x in grads)
    # Tk = 0
    inp = make_inputs(4, 10, 1, 64, 64, 576, False, False, gen)
    inp["kv"], inp["index_k"] = inp["kv"][:0], inp["index_k"][:0]
    loss, (d_iq, d_ik, _) = K.indexer_kl_loss_sparse(**inp, grad_rows=torch.ones(4, device="cuda"))
    assert bool((loss == 0).all()) and d_ik.shape == (0, 128) and bool((d_iq == 0).all())


def test_matches_mean_loss_of_public_reference():
    """The mean of the rows and the gradients of the mean equal the oracle's scalar loss."""
    gen = torch.Generator().manual_seed(11)
    inp = make_inputs(41, 300, 700, 64, 64, 576, True, False, gen)
    t = 41
    loss, (d_iq, d_ik, d_w) = K.indexer_kl_loss_sparse(**inp, grad_rows=torch.full((t,), 1.0 / t, device="cuda"))
    iq = inp["index_q"].float().requires_grad_()
    ik = inp["index_k"].float().requires_grad_()
    w = inp["weights"].float().requires_grad_()
    idx = inp["topk_indices"].long()
    idx = torch.where(idx < 700, idx, -1)
    ref = indexer_kl_loss_reference(iq, ik, w, inp["q"].float(), inp["kv"].float(), inp["attn_lse"],
                                    inp["scale"], topk_indices=idx)
    ref.backward()
    assert abs(loss.mean().item() - ref.item()) <= 1e-4 * max(1.0, abs(ref.item()))
    assert rel_err(d_w, w.grad) < 2e-3 and rel_err(d_iq, iq.grad) < 2e-2 and rel_err(d_ik, ik.grad) < 2e-2


# (T, k, Tk, Hi, Di, kind of target): the fused path's program (target given)
FROM_PROBS_CASES = [
    (37, 100, 300, 64, 128, "random"),
    (33, 130, 257, 32, 128, "random"),      # GLM-5 index heads, padded to 64 inside
    (17, 2048, 4000, 64, 128, "random"),
    (21, 4096 + 7, 5000, 64, 128, "random"),  # k beyond 4096, not a multiple of the block pair
    (29, 64, 90, 64, 64, "peaked"),          # small index dim; one slot holds nearly all mass
    (11, 70, 3, 16, 32, "zeros"),            # Tk < k; some rows with slots but zero target
]


def _from_probs_inputs(t, k, tk, hi, di, kind, gen):
    bf = torch.bfloat16
    iq = torch.randn(t, hi, di, generator=gen).to(bf)
    ik = torch.randn(tk, di, generator=gen).to(bf)
    w = torch.randn(t, hi, generator=gen) * (hi ** -0.5) * (di ** -0.5) * 4.0
    w[:, 0] = 0.0  # a head with zero weight still gets its d_weights
    idx = random_indices(1, t, k, tk, generator=gen, empty_rows=2)[0]
    probs = torch.rand(t, k, generator=gen) * 3.0
    if kind == "peaked":
        probs = probs * 1e-6
        probs[:, 0] = 5.0
    if kind == "zeros":
        probs[::2] = 0.0
    g = (torch.rand(t, generator=gen) + 0.5) / t
    return [x.cuda() for x in (iq, ik, w, idx, probs, g)]


def _from_probs_oracle(iq, ik, w, idx, probs, g):
    """float64 loss rows and (d_index_q, d_index_k, d_weights) of sum_t g_t * loss_t given the target probs:
    one reference call per row, so that every row gets its own gradient weight."""
    tk = ik.shape[0]
    leaves = [x.double().requires_grad_() for x in (iq, ik, w)]
    rows_idx = torch.where((idx >= 0) & (idx < tk), idx.long(), -1)
    ref_rows, total = [], 0
    for r in range(iq.shape[0]):
        v = indexer_kl_loss_reference(leaves[0][r:r + 1], leaves[1], leaves[2][r:r + 1], None, None, None, None,
                                      topk_indices=rows_idx[r:r + 1], attn_probs=probs[r:r + 1].double())
        ref_rows.append(v.detach())
        total = total + v * g[r].double()
    total.backward()
    return torch.stack(ref_rows), leaves[0].grad, leaves[1].grad, leaves[2].grad


@pytest.mark.parametrize("case", FROM_PROBS_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-Tk{c[2]}-Hi{c[3]}-Di{c[4]}-{c[5]}")
def test_loss_from_probs_matches_oracle(case):
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) % (2**31))
    t, k, tk = case[:3]
    iq, ik, w, idx, probs, g = _from_probs_inputs(*case, gen)
    loss, (d_iq, d_ik, d_w) = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g)
    assert torch.equal(K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs)[0], loss)
    torch.cuda.synchronize()
    for name, x in (("loss", loss), ("d_index_q", d_iq), ("d_index_k", d_ik), ("d_weights", d_w)):
        _finite(name, x)
    assert d_iq.shape == iq.shape and d_iq.dtype == torch.bfloat16 and d_w.shape == w.shape
    ref_rows, ref_iq, ref_ik, ref_w = _from_probs_oracle(iq, ik, w, idx, probs, g)
    empty = ~((idx >= 0) & (idx < tk)).any(1)
    assert bool(empty.any()) and bool((loss[empty] == 0).all()) and bool((d_iq[empty] == 0).all())
    err = (loss.double() - ref_rows).abs().max().item()
    assert err <= 2e-4 * max(1.0, ref_rows.abs().max().item()), f"loss rows: max abs err {err:.3e}"
    for name, got, want in (("d_weights", d_w, ref_w), ("d_index_q", d_iq, ref_iq), ("d_index_k", d_ik, ref_ik)):
        tol = 2e-3 if name == "d_weights" else 2e-2
        assert rel_err(got, want) < tol, f"{name} rel err {rel_err(got, want):.3e}"
    assert d_w[:, 0].abs().sum() > 0  # zero weight, nonzero gradient


# the deterministic mode's d_index_k (per-slot rows summed in a fixed order): index dims 128 / 64 / 32, k past
# 4096, Tk < k (many slots naming one row)
DET_CASES = [FROM_PROBS_CASES[i] for i in (0, 3, 4, 5)]


def _kp(k):
    return -(-k // K.SLOT_STEP) * K.SLOT_STEP


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("case", DET_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-Tk{c[2]}-Hi{c[3]}-Di{c[4]}-{c[5]}")
def test_deterministic_d_index_k_repeats_bitwise_and_matches(case, chunks, monkeypatch):
    """deterministic=True: d_index_k bitwise equal over repeated calls, within 1e-5 of the atomic mode's (the
    same values added in another order) and of float64; the loss rows, d_index_q and d_weights bitwise the
    atomic mode's; index_k rows no slot names exactly 0. ``chunks`` 3: the rows in three launches (a small
    contribution budget), each reduce adding onto the last."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) % (2**31) + 1)
    t, k, tk, hi, di = case[:5]
    iq, ik, w, idx, probs, g = _from_probs_inputs(*case, gen)
    loss0, (d_iq0, d_ik0, d_w0) = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g)
    if chunks > 1:
        monkeypatch.setattr(K, "_DET_BUDGET_BYTES", -(-t // chunks) * _kp(k) * di * 4)
    runs = [K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=True) for _ in range(5)]
    loss, (d_iq, d_ik, d_w) = runs[0]
    for other, (o_iq, o_ik, o_w) in runs[1:]:
        assert torch.equal(other, loss) and torch.equal(o_iq, d_iq) and torch.equal(o_w, d_w)
        assert torch.equal(o_ik, d_ik), "d_index_k differs between two deterministic runs"
    _finite("d_index_k", d_ik)
    assert torch.equal(loss, loss0) and torch.equal(d_iq, d_iq0) and torch.equal(d_w, d_w0)
    assert rel_err(d_ik, d_ik0) < 1e-5, f"d_index_k vs the atomic mode: rel err {rel_err(d_ik, d_ik0):.3e}"
    named = torch.zeros(tk, dtype=torch.bool, device="cuda")
    valid = (idx >= 0) & (idx < tk)
    named[idx[valid].long()] = True
    assert bool((d_ik[~named] == 0).all()) and bool(named.any())
    ref_ik = _from_probs_oracle(iq, ik, w, idx, probs, g)[2]
    assert rel_err(d_ik, ref_ik) < 2e-2, f"d_index_k vs float64: {rel_err(d_ik, ref_ik):.3e}"


def test_deterministic_d_index_k_standalone_and_nan():
    """The standalone loss (target recomputed from the attention inputs) takes the same deterministic path;
    a NaN index_q row makes the same d_index_k entries NaN as the atomic mode (never hidden)."""
    case = CASES[2]
    gen = torch.Generator().manual_seed(5)
    inp = make_inputs(*case, gen)
    t = case[0]
    g = (torch.rand(t, generator=gen) + 0.5).cuda() / t
    _, (_, d_ik0, _) = K.indexer_kl_loss_sparse(**inp, grad_rows=g)
    a = K.indexer_kl_loss_sparse(**inp, grad_rows=g, deterministic=True)
    b = K.indexer_kl_loss_sparse(**inp, grad_rows=g, deterministic=True)
    assert torch.equal(a[1][1], b[1][1]) and rel_err(a[1][1], d_ik0) < 1e-5
    row = int(((inp["topk_indices"] >= 0) & (inp["topk_indices"] < case[2])).sum(1).argmax())
    inp["index_q"][row, 0, 0] = float("nan")
    _, (_, nan0, _) = K.indexer_kl_loss_sparse(**inp, grad_rows=g)
    _, (_, nan1, _) = K.indexer_kl_loss_sparse(**inp, grad_rows=g, deterministic=True)
    assert bool(nan0.isnan().any()) and torch.equal(nan0.isnan(), nan1.isnan())


def _index_lse(iq, ik, w, idx):
    """float64 lse of the indexer logits over each row's valid slots (duplicates counted as often as they
    appear, like the loss's softmax), -inf for a row without one: what indexer_topk(return_lse=True) gives."""
    tk = ik.shape[0]
    valid = (idx >= 0) & (idx < tk)
    rows = ik.double()[idx.long().clamp(0, tk - 1)]  # [t, k, di]
    logits = (torch.einsum("thd,tkd->thk", iq.double(), rows).relu() * w.double()[:, :, None]).sum(1)
    return torch.logsumexp(logits.masked_fill(~valid, float("-inf")), -1)


@pytest.mark.parametrize("det", [False, True])
@pytest.mark.parametrize("case", FROM_PROBS_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-Tk{c[2]}-Hi{c[3]}-Di{c[4]}-{c[5]}")
def test_loss_with_index_lse_skips_pass_one(case, det):
    """index_lse given (the indexer's forward computed it): one pass over the slots. Loss rows and gradients
    agree with the two-pass program (the same math; I_j rounded in another order) and with float64; rows
    without a slot stay exactly 0; and the given lse is what the program uses (a shifted lse shifts each
    loss row with a target by exactly that much)."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()) % (2**31) + 2)
    t, k, tk = case[:3]
    iq, ik, w, idx, probs, g = _from_probs_inputs(*case, gen)
    lse = _index_lse(iq, ik, w, idx)
    loss0, (d_iq0, d_ik0, d_w0) = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=det)
    loss, (d_iq, d_ik, d_w) = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=det,
                                                          index_lse=lse.float())
    torch.cuda.synchronize()
    for name, x in (("loss", loss), ("d_index_q", d_iq), ("d_index_k", d_ik), ("d_weights", d_w)):
        _finite(name, x)
    valid = (idx >= 0) & (idx < tk)
    empty = ~valid.any(1)
    assert bool(empty.any()) and bool((loss[empty] == 0).all()) and bool((d_iq[empty] == 0).all())
    assert bool((d_w[empty] == 0).all())
    err = (loss - loss0).abs().max().item()
    assert err <= 2e-5 * max(1.0, loss0.abs().max().item()), f"loss rows vs two passes: max abs err {err:.3e}"
    for name, got, want in (("d_weights", d_w, d_w0), ("d_index_q", d_iq, d_iq0), ("d_index_k", d_ik, d_ik0)):
        tol = 1e-4 if name != "d_index_q" else 1e-2  # d_index_q is bf16 (one rounding step apart)
        assert rel_err(got, want) < tol, f"{name} vs two passes: rel err {rel_err(got, want):.3e}"
    if det:
        again = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=True, index_lse=lse.float())
        assert torch.equal(again[1][1], d_ik), "d_index_k differs between two deterministic runs"
    _, ref_iq, ref_ik, ref_w = _from_probs_oracle(iq, ik, w, idx, probs, g)
    for name, got, want in (("d_weights", d_w, ref_w), ("d_index_q", d_iq, ref_iq), ("d_index_k", d_ik, ref_ik)):
        tol = 2e-3 if name == "d_weights" else 2e-2
        assert rel_err(got, want) < tol, f"{name} vs float64: rel err {rel_err(got, want):.3e}"
    shifted, _ = K.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, index_lse=(lse + 1.0).float())
    has_target = valid.any(1) & (torch.where(valid, probs, 0.0).sum(1) > 0)
    assert bool(has_target.any())
    assert torch.allclose(shifted[has_target] - loss[has_target], torch.ones_like(loss[has_target]), atol=1e-4)


def test_standalone_loss_with_index_lse():
    """The standalone loss (target recomputed from the attention inputs) takes index_lse the same way."""
    case = CASES[3]
    gen = torch.Generator().manual_seed(13)
    inp = make_inputs(*case, gen)
    t = case[0]
    g = (torch.rand(t, generator=gen) + 0.5).cuda() / t
    lse = _index_lse(inp["index_q"], inp["index_k"], inp["weights"], inp["topk_indices"]).float()
    loss0, grads0 = K.indexer_kl_loss_sparse(**inp, grad_rows=g)
    loss, grads = K.indexer_kl_loss_sparse(**inp, grad_rows=g, index_lse=lse)
    assert (loss - loss0).abs().max().item() <= 2e-5 * max(1.0, loss0.abs().max().item())
    for got, want, tol in zip(grads, grads0, (1e-2, 1e-4, 1e-4)):
        assert rel_err(got, want) < tol
    with pytest.raises(ValueError, match="index_lse must be"):
        K.indexer_kl_loss_sparse(**inp, grad_rows=g, index_lse=lse[:-1])
