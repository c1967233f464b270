"""Torch reference of the DeepSeek-V3.2 indexer KL loss (DSA.md 1.2), with its own backward.

For each query row t over a slot set J(t) (sparse: the selected top-k; dense: the causal window):

    p[t, j]  = sum_h exp(scale * <q[t,h], kv[j]> - lse'[t,h])  then L1-normalised over J(t)
    I[t, j]  = sum_h relu(<index_q[t,h], index_k[j]>) * weights[t,h]
    loss     = mean_t  sum_j p[t,j] * (log p[t,j] - log_softmax_J(I[t])[j])     (or sum_t w_t ... with row weights)

lse' is the attention normaliser: ``attn_lse`` (logaddexp'ed with the sink if one is given), or,
when ``attn_lse`` is None, the log-sum-exp over J(t) itself (what the sparse attention computes
in the sparse stage, and dense attention in the warm-up). p carries no gradient: the attention
inputs are detached. dL/dI = (softmax_J(I) - p) / T gives d_index_q, d_index_k and d_weights.
Rows whose set is empty contribute 0 (and count in the mean). Memory: chunks of rows.
"""

from __future__ import annotations

import torch

from .sparse_attention import add_rows_in_order, gather_valid_rows

_CHUNK_ELEMS = 1 << 25


def _row_slots(t0, t1, topk_indices, key_start, key_end, device):
    """(rows [c, n] int64 global key rows, 0 where invalid; valid [c, n]) for query rows t0..t1."""
    if topk_indices is not None:
        idx = topk_indices[t0:t1].long()
        return idx.clamp_min(0), idx >= 0
    starts, ends = key_start[t0:t1].long(), key_end[t0:t1].long()
    lo = int(starts.min().item())
    hi = int(ends.max().item())
    cols = torch.arange(lo, max(hi, lo + 1), device=device)
    valid = (cols.unsqueeze(0) >= starts.unsqueeze(1)) & (cols.unsqueeze(0) < ends.unsqueeze(1))
    return cols.unsqueeze(0).expand_as(valid), valid


def _chunk_terms(iq, ik_rows, w, q, kv_rows, valid, lse, sink, scale, probs=None):
    """Attention target p [c, n] (no grad), indexer logits relu part [c, Hi, n] and scores I [c, n].
    probs [c, n]: the head sum of the attention probabilities, given (q and kv are then unused)."""
    if probs is not None:
        pa = torch.where(valid, probs, torch.zeros_like(probs))
    else:
        s = torch.einsum("chd,cnd->chn", q, kv_rows) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        norm = torch.logsumexp(s, dim=-1) if lse is None else lse
        if sink is not None:
            norm = torch.logaddexp(norm, sink.to(norm.dtype))
        # masked, not scrubbed: exactly 0 at invalid slots, NaN where the attention inputs carry NaN
        pa = torch.where(valid.unsqueeze(1), torch.exp(s - norm.unsqueeze(-1)), 0.0).sum(1)  # [c, n]
    total = pa.sum(-1, keepdim=True)
    p = torch.where(total == 0, torch.zeros_like(pa), pa / total)  # == 0, not > 0: a NaN total stays NaN
    logits = torch.einsum("chd,cnd->chn", iq, ik_rows)
    scores = torch.einsum("chn,ch->cn", logits.clamp_min(0), w).masked_fill(~valid, float("-inf"))
    return p, logits, scores


def _attention_chunk(q, kv, attn_lse, probs, rows, valid, t0, t1, cdt):
    """(q rows, gathered kv rows, lse or None) of rows t0..t1; Nones when the target comes as probs."""
    if probs is not None:
        return None, None, None
    lse = None if attn_lse is None else attn_lse[t0:t1].to(cdt)
    return q[t0:t1].to(cdt), gather_valid_rows(kv, rows, valid, cdt), lse


def _row_weights(row_weights, t0, t1, t_total, cdt, device):
    """Each row's factor in the loss [t1 - t0]: ``row_weights`` or the mean's 1 / T."""
    if row_weights is None:
        return torch.full((t1 - t0,), 1.0 / max(t_total, 1), dtype=cdt, device=device)
    return row_weights[t0:t1].to(device=device, dtype=cdt)


def _chunks(t_total, n_slots, heads):
    step = max(1, _CHUNK_ELEMS // max(1, n_slots * heads))
    for t0 in range(0, t_total, step):
        yield t0, min(t0 + step, t_total)


class IndexerKLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, index_q, index_k, weights, q, kv, attn_lse, sink, topk_indices, key_start, key_end, scale,
                probs=None, row_weights=None):
        cdt = torch.float64 if index_q.dtype == torch.float64 else torch.float32
        t_total = index_q.shape[0]
        h = 1 if probs is not None else q.shape[1]
        n_guess = topk_indices.shape[1] if topk_indices is not None else index_k.shape[0]
        loss = torch.zeros((), dtype=cdt, device=index_q.device)
        for t0, t1 in _chunks(t_total, n_guess, max(h, index_q.shape[1])):
            rows, valid = _row_slots(t0, t1, topk_indices, key_start, key_end, index_q.device)
            qc, kv_rows, lse = _attention_chunk(q, kv, attn_lse, probs, rows, valid, t0, t1, cdt)
            p, _, scores = _chunk_terms(
                index_q[t0:t1].to(cdt), gather_valid_rows(index_k, rows, valid, cdt), weights[t0:t1].to(cdt), qc,
                kv_rows, valid, lse, sink, scale, None if probs is None else probs[t0:t1].to(cdt),
            )
            logq = torch.log_softmax(scores, dim=-1)
            # p == 0 (not p > 0): a NaN target gives a NaN loss instead of vanishing
            term = torch.where(p == 0, torch.zeros_like(p), p * (torch.log(p.clamp_min(torch.finfo(cdt).tiny)) - logq))
            loss = loss + (term.sum(-1) * _row_weights(row_weights, t0, t1, t_total, cdt, index_q.device)).sum()
        ctx.save_for_backward(index_q, index_k, weights, q, kv, attn_lse, sink, topk_indices, key_start, key_end,
                              probs, row_weights)
        ctx.scale = scale
        return loss

    @staticmethod
    def backward(ctx, grad):
        (index_q, index_k, weights, q, kv, attn_lse, sink, topk_indices, key_start, key_end, probs,
         row_weights) = ctx.saved_tensors
        cdt = torch.float64 if index_q.dtype == torch.float64 else torch.float32
        dev = index_q.device
        t_total = index_q.shape[0]
        h = 1 if probs is not None else q.shape[1]
        d_iq = torch.zeros(index_q.shape, dtype=cdt, device=dev)
        d_ik = torch.zeros(index_k.shape, dtype=cdt, device=dev)
        d_w = torch.zeros(weights.shape, dtype=cdt, device=dev)
        n_guess = topk_indices.shape[1] if topk_indices is not None else index_k.shape[0]
        for t0, t1 in _chunks(t_total, n_guess, max(h, index_q.shape[1])):
            rows, valid = _row_slots(t0, t1, topk_indices, key_start, key_end, dev)
            iq, w = index_q[t0:t1].to(cdt), weights[t0:t1].to(cdt)
            ik_rows = gather_valid_rows(index_k, rows, valid, cdt)
            qc, kv_rows, lse = _attention_chunk(q, kv, attn_lse, probs, rows, valid, t0, t1, cdt)
            p, logits, scores = _chunk_terms(
                iq, ik_rows, w, qc, kv_rows, valid, lse, sink, ctx.scale,
                None if probs is None else probs[t0:t1].to(cdt),
            )
            has_slot = valid.any(-1, keepdim=True)
            d_scores = torch.where(has_slot, torch.softmax(scores, dim=-1) - p, torch.zeros_like(p))
            coeff = grad.to(cdt) * _row_weights(row_weights, t0, t1, t_total, cdt, dev)[:, None]
            d_scores = d_scores.masked_fill(~valid, 0.0) * coeff  # [c, n]
            d_w[t0:t1] = torch.einsum("cn,chn->ch", d_scores, torch.where(valid.unsqueeze(1), logits.clamp_min(0), 0.0))
            # relu's gradient as torch takes it (zero where logits <= 0): a NaN logit passes its gradient on
            d_logits = d_scores.unsqueeze(1) * w.unsqueeze(-1) * ~(logits <= 0)  # [c, Hi, n]
            d_iq[t0:t1] = torch.einsum("chn,cnd->chd", d_logits, ik_rows)
            contrib = torch.einsum("chn,chd->cnd", d_logits, iq)
            add_rows_in_order(d_ik, rows[valid], contrib[valid])
        return (d_iq.to(index_q.dtype), d_ik.to(index_k.dtype), d_w.to(weights.dtype)) + (None,) * 10


def indexer_kl_loss_reference(
    index_q, index_k, weights, q, kv, attn_lse, scale: float,
    topk_indices=None, key_start=None, key_end=None, sink=None, attn_probs=None, row_weights=None,
):
    """Scalar loss; gradients flow to index_q [T,Hi,Di], index_k [Tk,Di], weights [T,Hi] only.

    q [T,H,Dqk], kv [Tk,Dqk] (the attention's inputs, detached), attn_lse [T,H] or None,
    topk_indices [T,k] (sparse, global rows of kv, -1 = none) or key_start/key_end [T] (dense).
    attn_probs [T,k] (sparse only): the head-summed attention probabilities of the slots, given
    (what the attention backward emits); q, kv, attn_lse, sink and scale are then unused (None).
    row_weights [T] (optional): each row's factor, replacing the mean's 1 / T (e.g. 1 / n_valid on
    real tokens and 0 on padding, or 1 for a per-token sum).
    """
    if attn_probs is not None and topk_indices is None:
        raise ValueError("attn_probs needs topk_indices (the sparse loss)")
    return IndexerKLLoss.apply(
        index_q, index_k, weights, None if q is None else q.detach(), None if kv is None else kv.detach(),
        None if attn_lse is None else attn_lse.detach(),
        None if sink is None else sink.detach(),
        topk_indices, key_start, key_end, scale, None if attn_probs is None else attn_probs.detach(),
        None if row_weights is None else row_weights.detach(),
    )
