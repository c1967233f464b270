"""Indexer forward and the sparse and dense indexer KL losses: ours (TileLang) beside cuDNN frontend's Hopper kernels.

    python benchmarks/peers/bench_cudnn_indexer.py [--t 8192,32768] [--skip-loss] [--skip-sparse] [--skip-dense]
        [--out DIR] [--rounds N]

One causal sequence of T tokens; indexer sizes of DeepSeek-V3.2 / GLM-5 (Hi 64, Di 128, k 2048), attention
sizes of GLM-5 for the loss target (H 64, Dqk 576, Dv 512). Ours and the peer run in one process on the
same inputs; each peer's outputs are checked first (rel L2 <= AGREE from common.py, NaN fails) and a
disagreement goes to the row's error column instead of a time. Rows are appended to
benchmarks/results/kernels.csv (or DIR/kernels.csv); ours / peer speeds are printed at the end.

op indexer_topk, mode fwd, shape "T{t} Hi64 Di128 k2048 causal", FLOPs 2*Hi*Di*T*(T+1)/2 for every row (effective:
ours leaves the first k rows, which select their whole window, unscored):
  tilelang         dsa_plugins.ops.indexer_topk (scores and top-k in one op, -1 past the prefix); variant
                   return_lse: also each row's logsumexp of its selected scores (what the loss below takes);
                   variant score_whole_windows: the kernel call that also scores the first k rows (each
                   selects its whole window; the op leaves them unscored)
  cudnn_fe_scores  cuDNN DSA.indexer_forward_wrapper: the dense [T, T] fp32 scores only (no selection)
  cudnn_fe         the same + torch.topk (+ -1 for masked slots, our output contract)
  cudnn_fe_radix   the same + cuDNN's radix DSA.indexer_top_k_wrapper (the top-k megatron's cudnn backend uses)
op indexer_loss_sparse, shape "T{t} H64 D576 Hi64 Di128 k2048", FLOPs not counted (NaN):
  tilelang full    indexer_kl_loss_sparse, attn_lse given: loss value + d_index_q, d_index_k, d_weights
  tilelang fused   derived, as bench_indexer_loss.py: attn_bwd(return_probs) - attn_bwd + loss_from_probs
  (variant index_lse: both given lse(I) over the slots, as indexer_topk(return_lse=True) returns it: no
  first pass over the logits; the indexer's extra cost for it is its return_lse row minus its plain row)
  cudnn_fe full    DSA.sparse_indexer_score_recompute_wrapper + sparse_attn_score_recompute_wrapper + the
                   KL value in torch + DSA.indexer_backward_wrapper
op indexer_loss_dense (the warm-up loss: every causal key), shape "T{t} H64 D576 Hi64 Di128 causal", FLOPs NaN:
  tilelang full    indexer_kl_loss with windows [0, t], attn_lse None (recomputed by its kernels, as our megatron
                   backend calls it: the warm-up attention is sparse, so no dense LSE exists), grads by autograd
  tilelang lse     the same with the dense attention LSE given
  cudnn_fe full    megatron's dense path: the dense attention LSE in torch (fp32, row chunks), then
                   DSA.dense_indexer_score_recompute_wrapper + dense_attn_score_recompute_wrapper + the KL value
                   in torch + DSA.dense_indexer_backward_wrapper
  cudnn_fe lse     the same cuDNN kernels and torch KL, the LSE given (kernels against kernels)
"""

# Notes from reading megatron-core 0.19.2 (transformer/experimental_attention_variant/dsa_cudnn_kernels.py)
# and the cuDNN frontend 1.32 wrappers (deepseek_sparse_attention/{indexer_forward,score_recompute,
# indexer_backward}/api.py and their _interface_sm90.py):
#
# Indexer forward. indexer_forward_wrapper(q [B,S,Hi,Di] bf16, k [B,Sk,1,Di] bf16, w [B,S,Hi] bf16 or fp32,
#   ratio, sm_scale) -> {"scores": [B,S,Sk] fp32}, -inf where masked. The mask is key s < (t + 1) // ratio
#   (top-left aligned, q_causal_offsets None), so ratio=1 is our causal window [0, t]; the default ratio
#   is 4 (compressed keys), hence ratio=1 here as megatron passes. On SM90 only the dense score tensor
#   exists (the fused scores + top-k indexer_forward_top_k_wrapper is SM100-only), and the wrapper fills
#   the whole [T, T] buffer with -inf before the kernel: that fill is part of the peer's time.
#   Megatron selects with cuDNN's radix indexer_top_k_wrapper (seq_lens = t + 1, next_n 1, default
#   tie_break); we also time torch.topk, as asked. fp32 weights go in as they are.
#
# Sparse loss, one definition on both sides (DSA.md 1.2, dsa_plugins/reference/indexer_loss.py):
#   p[t,j] = sum_h exp(scale <q_th, kv_j> - lse_th), L1-normalised over the selected slots j of row t;
#   loss = mean_t sum_j p[t,j] (log p[t,j] - log softmax_j(I[t])[j]).
#   Ours: indexer_kl_loss_sparse returns the per-row KL; the value is sum_t rows[t] * g[t] and the
#   gradients are taken with grad_rows g = 1 / T, i.e. of the mean.
#   cuDNN: sparse_attn_score_recompute returns p already L1-normalised (SM90 and SM100 kernels alike);
#   megatron normalises again after a TP all-reduce, a no-op at TP 1, so we skip it. The value is computed
#   in torch from target and predict, as megatron does (megatron: kl.sum(-1).mean() * loss_coeff when
#   calculate_per_token_loss is False). indexer_backward folds grad_scale = loss_coeff / (B * S_q) into its
#   score gradient; with B 1, loss_coeff 1 and grad_loss 1 that is our 1 / T. So no conversion is needed:
#   both sides are the mean over rows, with the same normaliser. (With calculate_per_token_loss, a sum over
#   rows, megatron passes loss_coeff * B * S_q to cancel that factor; not used here.)
#   cuDNN's score gradient is g_i - predict_i * sum(g) with g_i = -max(target_i, tiny) * grad_scale, gated on
#   predict_i >= tiny: (predict - target) / T when the target sums to 1, as ours.
#   Differences we keep, each as megatron does:
#   - weights: cuDNN's sparse indexer recompute and backward take bf16 weights only (the SM90 recompute
#     asserts weights.dtype == q.dtype). The loss inputs' weights are therefore drawn bf16-representable
#     (w.bfloat16().float()): ours gets them in fp32 and cuDNN in bf16, the same values.
#   - -1 slots: with topk_length, the SM90 recompute kernels treat every slot < topk_length as valid (a -1
#     there would be scored as a zero key) and write 0 past it, so indices must be compact: valid slots
#     first. causal_topk below gives exactly that (torch.topk of random scores with -1 past the prefix);
#     we check it and pass topk_length = number of valid slots, as megatron does. The backward has no
#     topk_length: its -1 slots become index 0 (their target is 0 and their predict is clamped to tiny,
#     so they contribute ~1e-38 * grad_scale), and predict is clamp_min(tiny) because the score-gradient
#     kernel gates on predict >= tiny (megatron's _CLIP_PROB_MIN).
#   - outputs: d_index_q and d_weights come out bf16 (the default backend's dW store rounds to bf16),
#     d_index_k bf16 (the wrapper allocates it like index_k, as megatron lets it); ours gives d_index_k
#     and d_weights in fp32. Compared in fp32 by rel_diff.
#   - megatron's sparse loss never calls sparse_indexer_score_recompute_wrapper: its index scores are the
#     top-k values of its own indexer forward, turned into log-probs in torch (masked_log_softmax). A
#     standalone loss is given the indices, not the scores, so the peer recomputes them with cuDNN's
#     kernel for exactly that; it returns probabilities only (the wrapper does not expose log-probs), so
#     the value uses log(predict) where megatron uses log_softmax(scores): equal unless a selected predict
#     underflows fp32 (not with these inputs: scores spread by ~1, over 2048 slots).
#   - SM90 vs SM100: megatron pads index heads to 64 for the backward and attention heads to a multiple
#     of 64 (SM90) / 128 (SM100) for the target; Hi = H = 64 needs no padding. Megatron splits the
#     backward in row chunks only past the CUDA grid-Y limit (S_q > 65535), not reached here.
#
# Dense loss (megatron 0.19.2's _compute_dense_indexer_loss_and_grads, same module; cuDNN score_recompute/api.py,
# _interface_sm90.py, indexer_backward/api.py, dense_indexer_backward_sm90.py). BSHD, B 1 (SM90 kernels are
# BSHD-native; the THD path of the wrappers loops over sequences on the host), mask key s < (t + 1) // ratio
# with ratio 1: our causal window. All three have SM90 kernels.
#   dense_indexer_score_recompute_wrapper(q [B,S,Hi,Di] bf16, k [B,Sk,1,Di] bf16, weights [B,S,Hi] bf16 only,
#     qhead_per_kv_head, sm_scale, ratio) -> {"out": I [B,S,Sk] fp32, -inf where masked; "denom": logsumexp(I)}.
#     Megatron instead reuses the [S, S] scores of its indexer forward (indexer_forward_wrapper, also used for
#     its top-k) and takes torch.logsumexp; standalone, the scores are recomputed, and this kernel (which the
#     dense backward's docstring names as its input's source) gives both.
#   dense_attn_score_recompute_wrapper(q [B,S,H,D] bf16, k [B,Sk,1,D] bf16, lse [B,S,H] fp32, softmax_scale,
#     qhead_per_kv_head, ratio) -> {"out": sum_h exp(scale <q_h, k> - lse_h) [B,S,Sk] fp32, NOT normalised and
#     -inf (not 0) where masked; "denom": its L1 sum over the valid keys}. It needs the dense attention's LSE:
#     megatron computes it in torch (_compute_dense_attn_lse: fp32 einsum over every key, 1 GiB row chunks),
#     because its warm-up attention is sparse. dense_attn_lse below does the same math but crops each chunk's
#     keys to its causal prefix (about half megatron's FLOPs), so "cudnn_fe full" is if anything faster than
#     megatron's path. Ours recomputes the LSE inside its kernels (mode full) or takes it (mode lse).
#   dense_indexer_backward_wrapper(index_q, weights bf16, index_k [B,Sk,Di], attn_score, attn_l1norm,
#     index_score, index_lse, grad_loss, sm_scale, loss_coeff, block_I, ratio) -> d_index_q, d_weights bf16,
#     d_index_k like index_k (bf16 here, as megatron). Needs Hi >= 64. It consumes both score tensors in place
#     (its docstring; the SM90 kernel overwrites index_score) with the score gradient g_i - predict_i * sum(g),
#     g_i = -max(target_i, e^-100) * loss_coeff / (B * S_q), target = attn / (l1 + 1e-10): (predict - target)
#     / T, the gradient of the mean over rows, as ours. So the value is computed first, in torch, as megatron's _kl_loss_from_dense_scores
#     (position validity from isfinite(index_score), eps 1e-10). Megatron hands the backward clones of both
#     score tensors (2 x 4 GiB more at 32768) though it never reads them again; we pass them as they are.
#   Memory: the cuDNN path materialises [T, T] fp32 twice (index and attention scores: 4 GiB each at T 32768)
#   plus the torch KL's [T, T] temporaries, ~25-30 GiB at 32768 (fits an 80 GB H100); ours never holds
#   [T, T] (row chunks of at most 2^25 slots).
#
# Unsure (not verified on hardware when written): that the SM90 sparse indexer recompute (which megatron
# does not exercise) accepts topk 2048 with Hi 64 / Di 128 (its softmax keeps topk / 128 values per
# thread; the attention variant at topk 2048 is what megatron runs); that torch.topk on [32768, 32768]
# fp32 has no int32 limits on the GPU (2^30 elements). A refusal or a crash inside a peer call is caught
# and recorded in the row's error column. Dense: that the SM90 dense attention score kernel takes D 576 (megatron
# calls it so on GLM-5 / DeepSeek-V3.2); a peer wrapper that is missing or raises prints why and writes no row.

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import AGREE, Rows, error_text, import_peer, rel_diff, show_row  # noqa: E402

from dsa_plugins.bench.runner import interleaved_calls_ms, ratio_text  # noqa: E402

HI, DI, K = 64, 128, 2048  # indexer heads, head dim, top-k (DeepSeek-V3.2 / GLM-5)
H, DQK, DV = 64, 576, 512  # GLM-5 absorbed MLA attention (the loss target)
SETS_WARN = 0.99  # below this fraction of identical selected sets, say so loudly


# ----------------------------------------------------------------------------- indexer forward
def indexer_inputs(t: int):
    """index_q [T,Hi,Di] bf16, index_k [T,Di] bf16, weights [T,Hi] fp32: as dsa_plugins/bench/suites.py
    draws them (same seed), so the tilelang row matches the suite's rows in kernels.csv."""
    g = torch.Generator(device="cuda").manual_seed(0)
    iq = torch.randn(t, HI, DI, device="cuda", dtype=torch.bfloat16, generator=g)
    ik = torch.randn(t, DI, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.rand(t, HI, device="cuda", generator=g) * (HI * DI) ** -0.5
    return iq, ik, w


def scores_rel_to_reference(scores: torch.Tensor, iq, ik, w, key_start, key_end, rows_per_chunk: int = 64) -> float:
    """rel_diff(scores, reference) over the valid (causal) entries, accumulated over row chunks so
    that the reference's [rows, Hi, keys] fp32 product stays ~0.5 GiB. inf if any is non-finite."""
    from dsa_plugins.reference.indexer import indexer_scores

    t = scores.shape[0]
    num = torch.zeros((), dtype=torch.float64, device=scores.device)
    den = torch.zeros((), dtype=torch.float64, device=scores.device)
    for a in range(0, t, rows_per_chunk):
        b = min(a + rows_per_chunk, t)  # rows a..b-1 see keys < b at most
        ref = indexer_scores(iq[a:b], ik, w[a:b], key_start[a:b], key_end[a:b], 0, b)
        valid = torch.isfinite(ref)  # -inf outside each row's window
        got = scores[a:b, :b]
        num += torch.where(valid, got - ref, 0.0).double().square().sum()  # a -inf/NaN from cuDNN stays
        den += torch.where(valid, ref, 0.0).double().square().sum()
    rel = math.sqrt(num.item()) / max(math.sqrt(den.item()), 1e-30)
    return rel if math.isfinite(rel) else float("inf")


def same_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows whose selected indices (-1 included) are the same set: order is not part of
    the contract, so compare the sorted rows."""
    return float((a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1).float().mean())


def bench_indexer_fwd(rows: Rows, t: int, dsa, rounds: int = 0) -> None:
    from dsa_plugins.ops import causal_key_windows, indexer_topk

    shape, flops = f"T{t} Hi{HI} Di{DI} k{K} causal", 2.0 * HI * DI * t * (t + 1) / 2
    iq, ik, w = indexer_inputs(t)
    key_start, key_end = causal_key_windows(torch.tensor([0, t], device="cuda"), num_tokens=t)
    ours = lambda: indexer_topk(iq, ik, w, K, key_start, key_end, backend="tilelang")  # noqa: E731
    ours_err, ours_idx = None, None
    try:
        ours_idx = ours()
    except Exception as exc:  # noqa: BLE001 - recorded, the peers still run
        ours_err = error_text(exc)
    rows.time("indexer_topk", "fwd", shape, "tilelang", ours, flops, error=ours_err)
    with_lse = lambda: indexer_topk(iq, ik, w, K, key_start, key_end, backend="tilelang", return_lse=True)  # noqa: E731
    lse_err = ours_err
    if lse_err is None:
        try:
            if not torch.equal(with_lse()[0].sort(-1).values, ours_idx.sort(-1).values):  # row order unspecified
                lse_err = "return_lse changed the selection"
        except Exception as exc:  # noqa: BLE001
            lse_err = error_text(exc)
    rows.time("indexer_topk", "fwd", shape, "tilelang", with_lse, flops, error=lse_err, variant="return_lse")
    # before the causal prefill's first k rows were left unscored (they select their whole window): same rows
    from dsa_plugins.kernels.indexer import indexer_topk as kernel_topk

    scored = lambda: kernel_topk(iq, ik, w, key_start, key_end, K, score_whole_windows=True)  # noqa: E731
    scored_err = ours_err
    if scored_err is None:
        try:
            if not torch.equal(scored(), ours_idx):
                scored_err = "scoring the whole windows changed the rows"
        except Exception as exc:  # noqa: BLE001
            scored_err = error_text(exc)
    rows.time("indexer_topk", "fwd", shape, "tilelang", scored, flops, error=scored_err,
              variant="score_whole_windows")
    if dsa is None:
        return

    # the peer's layouts: [B,S,Hi,Di], one key head [B,Sk,1,Di], [B,S,Hi] (views, no copies)
    iq4, ik4, w3 = iq[None], ik[None, :, None, :], w[None]
    k_eff = min(K, t)
    seq_lens = torch.arange(1, t + 1, device="cuda", dtype=torch.int32)  # keys 0..t of row t

    def peer_scores():
        return dsa.indexer_forward_wrapper(iq4, ik4, w3, ratio=1, sm_scale=1.0)["scores"][0]

    def peer_torch_topk():
        vals, idx = torch.topk(peer_scores(), k_eff, dim=-1)
        idx = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)  # masked keys -> -1, as ours
        return idx if k_eff == K else torch.nn.functional.pad(idx, (0, K - k_eff), value=-1)

    def peer_radix_topk():
        res = dsa.indexer_top_k_wrapper(peer_scores(), seq_lens, top_k=k_eff, next_n=1, return_val=False)
        idx = res["indices"]  # int32, -1 past each row's seq_len
        return idx if k_eff == K else torch.nn.functional.pad(idx, (0, K - k_eff), value=-1)

    scores_err = None
    try:
        scores = peer_scores()
        d = scores_rel_to_reference(scores, iq, ik, w, key_start, key_end)
        print(f"  cudnn_fe scores vs torch reference (valid entries): rel {d:.2e}", flush=True)
        if d > AGREE:
            scores_err = f"disagrees with the reference: scores {d:.2e}"
        del scores
    except Exception as exc:  # noqa: BLE001 - a refusal is a result
        scores_err = error_text(exc)
    torch.cuda.empty_cache()
    rows.time("indexer_topk", "fwd", shape, "cudnn_fe_scores", peer_scores, flops, error=scores_err)
    if rounds and scores_err is None and ours_err is None:
        # the rows above are timed one after the other; here the two alternate, so that a drift during the run
        # (clocks, memory state: one 32K run put the same computation 6% apart by position) falls on both alike
        mine, peer = interleaved_calls_ms([ours, peer_scores], rounds)
        print(f"  alternating rounds ({rounds}, eager calls): tilelang {statistics.median(mine):.3f} ms, "
              f"cudnn_fe_scores {statistics.median(peer):.3f} ms, tilelang / cudnn_fe_scores speed "
              f"{ratio_text(peer, mine)}", flush=True)

    for provider, fn in (("cudnn_fe", peer_torch_topk), ("cudnn_fe_radix", peer_radix_topk)):
        error = scores_err
        if error is None:
            try:
                sel = fn()
                if ours_idx is not None:
                    # near-ties may fall either way between two fp32 accumulation orders: report, don't fail
                    frac = same_sets(sel, ours_idx)
                    loud = "   <<<<<< BELOW 0.99: CHECK" if frac < SETS_WARN else ""
                    print(f"  {provider} vs ours: identical selected sets in {100 * frac:.3f}% of rows{loud}",
                          flush=True)
                del sel
            except Exception as exc:  # noqa: BLE001
                error = error_text(exc)
        torch.cuda.empty_cache()
        rows.time("indexer_topk", "fwd", shape, provider, fn, flops, error=error)
    del ours_idx


# ----------------------------------------------------------------------------- sparse indexer loss
def causal_topk(t: int, k: int, g: torch.Generator, chunk: int = 1024) -> torch.Tensor:
    """[T, k] int32: k distinct random keys of each row's causal prefix, -1 past it. torch.topk returns
    them by descending random score and the masked keys (-1) score lowest, so valid slots come first."""
    idx = torch.full((t, k), -1, dtype=torch.int32, device="cuda")
    kk, cols = min(k, t), torch.arange(t, device="cuda")
    for a in range(0, t, chunk):
        b = min(a + chunk, t)
        r = torch.rand(b - a, t, device="cuda", generator=g)
        r.masked_fill_(cols[None] > torch.arange(a, b, device="cuda")[:, None], -1.0)
        v, i = r.topk(kk, dim=-1)
        idx[a:b, :kk] = torch.where(v >= 0, i, -1).to(torch.int32)
    return idx


def _loss_tensors(t: int, g: torch.Generator):
    """q, kv, index_q, index_k, weights of both losses, drawn in this order from g."""
    q = torch.randn(t, H, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t, DQK, device="cuda", dtype=torch.bfloat16, generator=g)
    iq = torch.randn(t, HI, DI, device="cuda", dtype=torch.bfloat16, generator=g)
    ik = torch.randn(t, DI, device="cuda", dtype=torch.bfloat16, generator=g)
    # bf16-representable fp32: cuDNN takes the same values in bf16 (see the notes at the top)
    w = (torch.randn(t, HI, device="cuda", generator=g) * (HI * DI) ** -0.5).bfloat16().float()
    return q, kv, iq, ik, w


def loss_inputs(t: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, kv, iq, ik, w = _loss_tensors(t, g)
    idx = causal_topk(t, K, g)
    valid = idx >= 0
    length = valid.sum(-1, dtype=torch.int32)
    if not bool((valid == (torch.arange(K, device="cuda")[None] < length[:, None])).all()):
        raise RuntimeError("causal_topk: valid slots must come first (cuDNN's topk_length contract)")
    return q, kv, iq, ik, w, idx, length


def _grads(loss, d_iq, d_ik, d_w) -> dict:
    return {"loss": loss, "d_index_q": d_iq, "d_index_k": d_ik, "d_weights": d_w}


def _compare(got: dict, ref: dict) -> tuple[dict, str | None]:
    d = {n: rel_diff(got[n], ref[n]) for n in ref}
    error = None if max(d.values()) <= AGREE else "disagrees with ours: " + " ".join(f"{n} {v:.2e}" for n, v in d.items())
    return d, error


def peer_loss_fn(dsa, iq, ik, w, q, kv, lse, idx, length, scale):
    """cuDNN's sparse loss, value and gradients, glued as megatron's _compute_sparse_indexer_loss_and_grads."""
    tiny = torch.finfo(torch.float32).tiny
    iq4, ik3, w_bf = iq[None], ik[None], w.bfloat16()[None]  # [1,T,Hi,Di], [1,T,Di], [1,T,Hi] bf16 (exact)
    q4, kv3, lse3 = q[None], kv[None], lse[None]  # [1,T,H,Dqk], [1,T,Dqk], [1,T,H] fp32 natural log
    idx3, len2 = idx[None].contiguous(), length[None].contiguous()  # local ids (B 1), compact; [1,T]
    idx_bwd = idx.clamp_min(0)[None].contiguous()  # the backward reads every slot: -1 -> row 0 (weight ~0)
    one = torch.ones((), device="cuda", dtype=torch.float32)  # grad_loss
    assert idx.shape[1] % 128 == 0, "indexer_backward wants k a multiple of block_I 128 (megatron pads)"

    def run() -> dict:
        predict = dsa.sparse_indexer_score_recompute_wrapper(
            iq4, ik3, w_bf, idx3, qhead_per_kv_head=HI, topk_length=len2)["predict"]  # softmax over slots
        target = dsa.sparse_attn_score_recompute_wrapper(
            q4, kv3, lse3, idx3, scale, qhead_per_kv_head=H, topk_length=len2)["target"]  # L1-normalised p
        predict = predict.clamp_min(tiny)  # 0 past topk_length; kept >= tiny for the gradient kernel's gate
        # target is exactly 0 past topk_length, so those slots add 0 * finite: no mask needed
        loss = (target * (torch.log(target.clamp_min(1e-10)) - torch.log(predict))).sum(-1).mean()
        # value first: the backward overwrites target (attn_score) with the score gradient
        gr = dsa.indexer_backward_wrapper(iq4, w_bf, ik3, target, predict, idx_bwd, grad_loss=one,
                                          sm_scale=1.0, loss_coeff=1.0, block_I=128)
        return _grads(loss, gr["d_index_q"][0], gr["d_index_k"][0], gr["d_weights"][0])

    return run


def index_lse_of(iq, ik, w, idx, rows_per_chunk: int = 256) -> torch.Tensor:
    """[T] fp32 lse of the indexer logits over each row's valid slots (what indexer_topk(return_lse=True) gives
    for the rows it selects), in torch over row chunks (fp32 logits of bf16 inputs)."""
    out = torch.empty(idx.shape[0], dtype=torch.float32, device=idx.device)
    for a in range(0, idx.shape[0], rows_per_chunk):
        b = min(a + rows_per_chunk, idx.shape[0])
        sl = idx[a:b]
        keys = ik[sl.long().clamp_min(0)].float()  # [r, k, Di]
        logits = (torch.einsum("rhd,rkd->rhk", iq[a:b].float(), keys).relu() * w[a:b, :, None]).sum(1)
        out[a:b] = torch.logsumexp(logits.masked_fill(sl < 0, float("-inf")), -1)
    return out


def fused_row(rows: Rows, shape: str, op: str, iq, ik, w, q, kv, idx, scale, out, lse, g, ref,
              index_lse=None) -> dict:
    """Our fused path's cost as bench_indexer_loss.py counts it: the attention backward's extra cost for
    emitting the head-summed P, plus the loss given P. Derived from three timings (no p20/p80).
    ``index_lse``: a second row (variant index_lse) with the loss given lse(I) too."""
    from dsa_plugins.bench.runner import time_callable
    from dsa_plugins.kernels import indexer_loss as L
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    row = {"op": op, "mode": "fused", "shape": shape, "provider": "tilelang", **rows.env}
    error = None
    try:
        q4, kv3, idx3 = q[None], kv[None], idx[None]
        dout = torch.randn_like(out)
        bwd = lambda: sparse_attention_bwd(q4, kv3, idx3, out, lse, dout, scale, dv=DV)  # noqa: E731
        bwd_p = lambda: sparse_attention_bwd(q4, kv3, idx3, out, lse, dout, scale, dv=DV, return_probs=True)  # noqa: E731
        probs = bwd_p()[3][0]
        from_probs = lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g)  # noqa: E731
        if ref is not None:  # same loss as the standalone one, from the attention's P
            loss_rows, (d_iq, d_ik, d_w) = from_probs()
            d, error = _compare(_grads((loss_rows * g).sum(), d_iq, d_ik, d_w), ref)
            print("  fused vs standalone: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
            if error:
                error = error.replace("ours", "our standalone")
        if error is None:
            dev = torch.device("cuda")
            (m_b, *_, p_b), (m_bp, *_, p_bp), (m_fp, *_, p_fp) = (time_callable(f, dev) for f in (bwd, bwd_p, from_probs))
            row.update(median_ms=m_bp - m_b + m_fp, tflops=float("nan"), peak_gib=max(p_b, p_bp, p_fp))
            print(f"  fused = attn_bwd+probs {m_bp:.3f} - attn_bwd {m_b:.3f} + loss_from_probs {m_fp:.3f} ms", flush=True)
            if index_lse is not None:
                with_lse = lambda: L.indexer_kl_loss_from_probs(  # noqa: E731
                    iq, ik, w, idx, probs, g, index_lse=index_lse)
                loss_rows, (d_iq, d_ik, d_w) = with_lse()
                d, lse_error = _compare(_grads((loss_rows * g).sum(), d_iq, d_ik, d_w), ref)
                print("  fused index_lse vs standalone: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
                lrow = {**row, "variant": "index_lse"}
                if lse_error:
                    lrow["error"] = lse_error.replace("ours", "our standalone")
                    lrow.pop("median_ms", None)
                else:
                    m_l, *_, p_l = time_callable(with_lse, dev)
                    lrow.update(median_ms=m_bp - m_b + m_l, peak_gib=max(p_b, p_bp, p_l))
                    print(f"  fused index_lse = attn_bwd+probs {m_bp:.3f} - attn_bwd {m_b:.3f} + loss_from_probs "
                          f"{m_l:.3f} ms", flush=True)
                rows.rows.append(lrow)
                show_row(lrow)
    except Exception as exc:  # noqa: BLE001
        error = error_text(exc)
    if error is not None:
        row["error"] = error
    rows.rows.append(row)
    show_row(row)
    torch.cuda.empty_cache()
    return row


def bench_loss(rows: Rows, t: int, dsa) -> None:
    from dsa_plugins.kernels import indexer_loss as L
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    op, shape, flops = "indexer_loss_sparse", f"T{t} H{H} D{DQK} Hi{HI} Di{DI} k{K}", float("nan")  # no formula in dsa_plugins
    scale = DQK ** -0.5
    q, kv, iq, ik, w, idx, length = loss_inputs(t)
    out, lse = sparse_attention_fwd(q[None], kv[None], idx[None], scale, dv=DV)  # lse [1,T,H]: both sides' normaliser
    lse2 = lse[0]
    g = torch.full((t,), 1.0 / t, device="cuda")  # d mean / d row

    def ours():
        loss_rows, (d_iq, d_ik, d_w) = L.indexer_kl_loss_sparse(iq, ik, w, q, kv, lse2, idx, scale, grad_rows=g)
        return _grads((loss_rows * g).sum(), d_iq, d_ik, d_w)

    ref, ours_err = None, None
    try:
        ref = ours()
    except Exception as exc:  # noqa: BLE001
        ours_err = error_text(exc)
    rows.time(op, "full", shape, "tilelang", ours, flops, error=ours_err)
    index_lse = index_lse_of(iq, ik, w, idx)

    def ours_lse():
        loss_rows, (d_iq, d_ik, d_w) = L.indexer_kl_loss_sparse(iq, ik, w, q, kv, lse2, idx, scale, grad_rows=g,
                                                                index_lse=index_lse)
        return _grads((loss_rows * g).sum(), d_iq, d_ik, d_w)

    lse_err = ours_err
    if lse_err is None:
        try:
            d, lse_err = _compare(ours_lse(), ref)
            print("  index_lse vs two passes: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
        except Exception as exc:  # noqa: BLE001
            lse_err = error_text(exc)
    rows.time(op, "full", shape, "tilelang", ours_lse, flops, error=lse_err, variant="index_lse")
    fused_row(rows, shape, op, iq, ik, w, q, kv, idx, scale, out, lse, g, ref, index_lse=index_lse)
    del out
    if dsa is None:
        return

    peer = None
    error = None if ref is not None else "not checked: our standalone loss failed"
    if error is None:
        try:
            peer = peer_loss_fn(dsa, iq, ik, w, q, kv, lse2, idx, length, scale)
            d, error = _compare(peer(), ref)
            print("  cudnn_fe vs ours: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
        except Exception as exc:  # noqa: BLE001
            error = error_text(exc)
    if error is not None:
        print(f"  cudnn_fe loss not timed: {error}", flush=True)
    torch.cuda.empty_cache()
    rows.time(op, "full", shape, "cudnn_fe", peer or (lambda: None), flops, error=error)


# ----------------------------------------------------------------------------- dense indexer loss
def dense_attn_lse(q: torch.Tensor, kv: torch.Tensor, scale: float, max_bytes: int = 1 << 30) -> torch.Tensor:
    """[T, H] fp32 natural-log LSE of causal dense attention, in torch as megatron's _compute_dense_attn_lse
    (fp32, row chunks of ~1 GiB of scores), but rows t0..t1 score only keys < t1."""
    t, h, _ = q.shape
    lse = torch.empty(t, h, device=q.device, dtype=torch.float32)
    kvf, cols = kv.float(), torch.arange(t, device=q.device)
    step = max(1, max_bytes // (h * t * 4))
    for a in range(0, t, step):
        b = min(a + step, t)
        s = torch.einsum("rhd,kd->rhk", q[a:b].float(), kvf[:b]) * scale
        s.masked_fill_(cols[None, None, :b] > cols[a:b, None, None], float("-inf"))
        lse[a:b] = torch.logsumexp(s, dim=-1)
    return lse


def peer_dense_loss_fn(dsa, iq, ik, w, q, kv, lse, scale):
    """cuDNN's dense loss, value and gradients, glued as megatron's _compute_dense_indexer_loss_and_grads.
    lse [T, H] given, or None: then computed in torch on every call, as megatron does."""
    # resolved now, so that a missing wrapper fails here and not inside the timing
    idx_scores, attn_scores, backward = (getattr(dsa, f"dense_{n}_wrapper") for n in (
        "indexer_score_recompute", "attn_score_recompute", "indexer_backward"))
    iq4, ik4, ik3, w_bf = iq[None], ik[None, :, None], ik[None], w.bfloat16()[None]  # w: exact (bf16 values)
    q4, kv4 = q[None], kv[None, :, None]  # [1,T,H,Dqk], one key head [1,T,1,Dqk]
    one = torch.ones((), device=iq.device, dtype=torch.float32)  # grad_loss
    eps = 1e-10  # megatron's INDEXER_LOSS_EPS

    def run() -> dict:
        lse3 = (dense_attn_lse(q, kv, scale) if lse is None else lse)[None]
        r = idx_scores(iq4, ik4, w_bf, qhead_per_kv_head=HI, sm_scale=1.0, ratio=1)
        score, score_lse = r["out"], r["denom"]  # raw I, -inf where masked; logsumexp(I)
        a = attn_scores(q4, kv4, lse3, scale, qhead_per_kv_head=H, ratio=1)
        attn, l1 = a["out"], a["denom"]  # head-summed P (-inf where masked), its L1 sum
        # the KL value as megatron's _kl_loss_from_dense_scores (every row has a valid key here)
        valid = torch.isfinite(score)
        target = attn / l1.clamp_min(eps)[..., None]
        log_predict = torch.where(valid, score, 0.0) - score_lse[..., None]
        loss = torch.where(valid, target * (torch.log(target.clamp_min(eps)) - log_predict), 0.0).sum(-1).mean()
        del valid, target, log_predict
        # value first: the backward overwrites the score tensors with the score gradient
        gr = backward(iq4, w_bf, ik3, attn, l1, score, score_lse, grad_loss=one, sm_scale=1.0, loss_coeff=1.0,
                      block_I=128, ratio=1)
        return _grads(loss, gr["d_index_q"][0], gr["d_index_k"][0], gr["d_weights"][0])

    return run


def bench_dense_loss(rows: Rows, t: int, dsa) -> None:
    from dsa_plugins.ops import causal_key_windows, indexer_kl_loss

    op, shape, flops = "indexer_loss_dense", f"T{t} H{H} D{DQK} Hi{HI} Di{DI} causal", float("nan")  # as the sparse op
    scale = DQK ** -0.5
    q, kv, iq, ik, w = _loss_tensors(t, torch.Generator(device="cuda").manual_seed(0))
    key_start, key_end = causal_key_windows(torch.tensor([0, t], device="cuda"), num_tokens=t)
    lse = dense_attn_lse(q, kv, scale)  # the peer's input; ours recomputes it (full) or takes it (lse)

    def ours_fn(attn_lse):
        def run() -> dict:
            leaves = [x.detach().requires_grad_() for x in (iq, ik, w)]
            loss = indexer_kl_loss(*leaves, q, kv, attn_lse, scale, key_start=key_start, key_end=key_end,
                                   backend="tilelang")
            return _grads(loss.detach(), *torch.autograd.grad(loss, leaves))
        return run

    refs = {}
    for mode, attn_lse in (("full", None), ("lse", lse)):
        fn, error = ours_fn(attn_lse), None
        try:
            refs[mode] = fn()
        except Exception as exc:  # noqa: BLE001
            error = error_text(exc)
        rows.time(op, mode, shape, "tilelang", fn, flops, error=error)
    if len(refs) == 2:
        print("  tilelang lse given vs recomputed: " + ", ".join(
            f"{n} {v:.2e}" for n, v in _compare(refs["lse"], refs["full"])[0].items()), flush=True)
    if dsa is None:
        return

    ref = refs.get("full", refs.get("lse"))
    try:  # a missing wrapper or a refusal (e.g. a shape its SM90 kernels decline) is said, not recorded
        peer = peer_dense_loss_fn(dsa, iq, ik, w, q, kv, lse, scale)
        got = peer()
    except Exception as exc:  # noqa: BLE001
        print(f"  cudnn_fe dense loss unavailable, no cudnn_fe rows: {error_text(exc)}", flush=True)
        torch.cuda.empty_cache()
        return
    error = "not checked: our dense loss failed" if ref is None else None
    if ref is not None:  # the LSE only moves time between the modes: one check serves both rows
        d, error = _compare(got, ref)
        print("  cudnn_fe vs ours: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
    del got
    if error is not None:
        print(f"  cudnn_fe dense loss not timed: {error}", flush=True)
    torch.cuda.empty_cache()
    rows.time(op, "full", shape, "cudnn_fe", peer_dense_loss_fn(dsa, iq, ik, w, q, kv, None, scale), flops, error=error)
    rows.time(op, "lse", shape, "cudnn_fe", peer, flops, error=error)


# ----------------------------------------------------------------------------- main
def dsa_namespace():
    """cuDNN frontend's DSA namespace (``from cudnn import DSA``), or None (import_peer says why)."""
    cudnn = import_peer("cudnn", "cudnn_fe")
    if cudnn is None:
        return None
    try:  # cudnn resolves DSA lazily: an import failure inside surfaces here, not as AttributeError
        return cudnn.DSA
    except Exception:  # noqa: BLE001 - older layouts: the module itself resolves the same names
        return import_peer("cudnn.deepseek_sparse_attention", "cudnn_fe")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", default="8192,32768", help="comma list of sequence lengths T (default 8192,32768)")
    ap.add_argument("--skip-loss", action="store_true", help="skip both losses: time the indexer forward only")
    ap.add_argument("--skip-fwd", action="store_true", help="skip the indexer forward + top-k")
    ap.add_argument("--skip-dense", action="store_true", help="skip the dense (warm-up) indexer loss")
    ap.add_argument("--skip-sparse", action="store_true", help="skip the sparse indexer loss")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="also time ours and cuDNN's scores in this many alternating rounds (printed, not in the csv)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cudnn_indexer needs a CUDA GPU (Hopper: cuDNN's SM90 kernels)", flush=True)
        return 1
    ts = [int(x) for x in args.t.split(",") if x.strip()]
    dsa = dsa_namespace()
    major, minor = torch.cuda.get_device_capability()
    if dsa is not None and major != 9:
        print(f"note: sm{major}{minor}, not Hopper: cuDNN runs its other kernels; rows still say cudnn_fe", flush=True)
    rows = Rows("kernels", args.out)
    for t in ts if not args.skip_fwd else ():
        bench_indexer_fwd(rows, t, dsa, args.rounds)
        rows.write()
        torch.cuda.empty_cache()
    if not (args.skip_loss or args.skip_sparse):
        for t in ts:
            bench_loss(rows, t, dsa)
            rows.write()
            torch.cuda.empty_cache()
    if not (args.skip_loss or args.skip_dense):
        for t in ts:
            bench_dense_loss(rows, t, dsa)
            rows.write()
            torch.cuda.empty_cache()
    rows.ratios()
    # the fused row has its own mode: set it beside the peer's full loss by hand
    full = {(r["shape"], r["provider"], r["mode"], r.get("variant", "")): r for r in rows.rows
            if r["op"] == "indexer_loss_sparse"}
    for (shape, provider, mode, variant), r in full.items():
        peer = full.get((shape, "cudnn_fe", "full", ""))
        if provider == "tilelang" and mode == "fused" and "median_ms" in r and peer and "median_ms" in peer:
            print(f"  indexer_loss_sparse fused {shape}: tilelang fused {variant} / cudnn_fe full speed = "
                  f"{peer['median_ms'] / r['median_ms']:.3f}")
    # index_lse comes from the indexer's forward: charge its extra cost there to the loss rows that take it
    fwd = {(r["shape"].split()[0], r.get("variant", "")): r for r in rows.rows
           if r["op"] == "indexer_topk" and r["provider"] == "tilelang" and "median_ms" in r}
    for (shape, provider, mode, variant), r in full.items():
        t_name = shape.split()[0]
        plain, with_lse = fwd.get((t_name, "")), fwd.get((t_name, "return_lse"))
        peer = full.get((shape, "cudnn_fe", "full", ""))
        if variant == "index_lse" and "median_ms" in r and plain and with_lse and peer and "median_ms" in peer:
            extra = with_lse["median_ms"] - plain["median_ms"]
            print(f"  indexer_loss_sparse {mode} {shape}: tilelang index_lse + the indexer's extra for it "
                  f"({extra:.3f} ms) = {r['median_ms'] + extra:.3f} ms; / cudnn_fe full speed = "
                  f"{peer['median_ms'] / (r['median_ms'] + extra):.3f}")
    rows.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
