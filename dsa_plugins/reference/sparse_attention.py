"""Torch reference of sparse attention over a shared latent: the oracle and the CPU path.

Layout: q [B, S, H, Dqk], kv [B, Skv, Dqk], indices [B, S, K] (rows into kv of the same batch;
an entry < 0 or >= Skv means "no key"), optional per-head sink [H] fp32. K = kv, V = kv[..., :dv].

    s_hj  = scale * <q_h, kv[idx_j]>                  (valid slots only)
    lse_h = log sum_j exp(s_hj)                        (natural log, sink excluded)
    out_h = sum_j exp(s_hj - lse_h) kv[idx_j, :dv]     (times exp(lse)/(exp(lse)+exp(z_h)) with a sink)

A row with no valid slot gives out 0, lse +inf and zero gradients, by masking: a NaN that the
inputs carry (q, a selected kv row, the sink, the upstream gradient) reaches every output and
gradient it touches, as in eager attention, and never leaks through an invalid slot (the gathered
row of an invalid slot is zero, its probability exactly 0). Queries are processed in
chunks, so memory is O(chunk * K * Dqk), never O(S * Skv). Math runs in float32 (float64 for
float64 inputs); outputs come back in q.dtype, lse in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

# Bytes of gathered rows one chunk may hold (the [chunk, K, Dqk] gather dominates memory).
_CHUNK_BYTES = 256 * 1024 * 1024


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows_per_chunk(k: int, d: int, h: int, itemsize: int) -> int:
    per_row = max(1, k * (d + 2 * h) * itemsize)
    return max(1, _CHUNK_BYTES // per_row)


def _flatten(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor):
    """[B,S,...] -> rows: q [B*S,H,D], kv [B*Skv,D], global row ids [B*S,K] (0 where invalid), valid mask."""
    b, s, h, d = q.shape
    skv = kv.shape[1]
    idx = indices.reshape(b * s, indices.shape[-1]).long()
    valid = (idx >= 0) & (idx < skv)
    base = (torch.arange(b, device=q.device) * skv).repeat_interleave(s).unsqueeze(1)
    rows = torch.where(valid, idx + base, torch.zeros_like(idx))
    return q.reshape(b * s, h, d), kv.reshape(b * skv, d), rows, valid


def gather_valid_rows(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` [c, K] of ``x`` [N, D] as [c, K, D] in the compute dtype, zero at invalid slots (as the
    kernels, which never load them): a NaN in a placeholder row cannot reach an unrelated output. An invalid
    slot's row number may lie past the rows (an empty window at the end), and there may be no row at all."""
    if x.shape[0] == 0:
        return torch.zeros(*rows.shape, x.shape[-1], dtype=cdt, device=x.device)
    return torch.where(valid.unsqueeze(-1), x[rows.clamp(0, x.shape[0] - 1)].to(cdt), 0.0)


def add_rows_in_order(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """dst[rows[i]] += values[i] (dst [N, D], rows [M] int64, values [M, D]), summed in the same order on every
    run: on the CPU ``index_add_`` adds the rows one after the other; on CUDA its atomics would add them in
    whichever order the threads reach them (bits that change from run to run), so the rows go through
    ``index_put_`` with ``accumulate=True``, which sorts them first. The torch path's gradients are then as
    reproducible as the kernels' deterministic mode, whatever torch's own determinism setting is."""
    if dst.is_cuda:
        dst.index_put_((rows,), values, accumulate=True)
    else:
        dst.index_add_(0, rows, values)


def _slot_probs(scores: torch.Tensor, norm: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """exp(scores - norm) at valid slots, exactly 0 at invalid ones (also where norm is +-inf)."""
    return torch.where(valid.unsqueeze(1), torch.exp(scores - norm.unsqueeze(-1)), 0.0)


def _chunk_scores(qc, kv_rows, valid_c, scale):
    """scores [c, H, K] in the compute dtype, -inf at invalid slots."""
    s = torch.einsum("chd,ckd->chk", qc, kv_rows) * scale
    return s.masked_fill(~valid_c.unsqueeze(1), float("-inf"))


def _normaliser(lse: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """log of the softmax denominator: lse, or logaddexp(lse, z) with a sink."""
    return lse if sink is None else torch.logaddexp(lse, sink.to(lse.dtype))


def sparse_attention_forward(q, kv, indices, scale: float, sink=None, dv: int | None = None):
    """No-grad forward: (out [B,S,H,dv] q.dtype, lse [B,S,H] fp32/fp64). See the module docstring."""
    b, s, h, d = q.shape
    dv = d if dv is None else dv
    cdt = compute_dtype(q.dtype)
    qf, kvf, rows, valid = _flatten(q, kv, indices)
    n, k = rows.shape
    out = torch.empty(n, h, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, h, dtype=cdt, device=q.device)
    z = None if sink is None else sink.to(cdt)
    step = _rows_per_chunk(k, d, h, torch.finfo(cdt).bits // 8)
    for start in range(0, n, step):
        sl = slice(start, min(start + step, n))
        kv_rows = gather_valid_rows(kvf, rows[sl], valid[sl], cdt)  # [c, K, D]
        scores = _chunk_scores(qf[sl].to(cdt), kv_rows, valid[sl], scale)
        lse_c = torch.logsumexp(scores, dim=-1)  # -inf for empty rows, NaN where the inputs carry NaN
        empty = ~valid[sl].any(-1, keepdim=True)  # [c, 1]: rows with no valid slot
        norm = _normaliser(lse_c, z)
        p = _slot_probs(scores, norm, valid[sl])  # empty rows: 0 everywhere, whatever norm is
        out[sl] = torch.einsum("chk,ckd->chd", p, kv_rows[..., :dv]).to(q.dtype)
        lse[sl] = torch.where(empty, float("inf"), lse_c)
    return out.reshape(b, s, h, dv), lse.reshape(b, s, h)


def sparse_attention_backward(q, kv, indices, out, lse, dout, scale: float, sink=None, dv: int | None = None,
                              return_probs: bool = False):
    """Gradients (dq q.dtype, dkv float32/float64, dsink or None) of sparse_attention_forward.

    dkv is returned in the accumulation dtype so head-chunked callers can sum it before one cast.
    return_probs=True adds probs [B,S,K] (accumulation dtype): sum over heads of the attention
    probabilities of each slot (sink in the normaliser, 0 for invalid slots), the indexer loss target.
    """
    b, s, h, d = q.shape
    dv = d if dv is None else dv
    cdt = compute_dtype(q.dtype)
    qf, kvf, rows, valid = _flatten(q, kv, indices)
    n, k = rows.shape
    outf = out.reshape(n, h, dv)
    doutf = dout.reshape(n, h, dv)
    lsef = lse.reshape(n, h).to(cdt)
    z = None if sink is None else sink.to(cdt)
    dq = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(kvf.shape[0], d, dtype=cdt, device=q.device)
    dsink = None if sink is None else torch.zeros(h, dtype=cdt, device=q.device)
    probs = torch.zeros(n, k, dtype=cdt, device=q.device) if return_probs else None
    step = _rows_per_chunk(k, d, h, torch.finfo(cdt).bits // 8)
    for start in range(0, n, step):
        sl = slice(start, min(start + step, n))
        qc = qf[sl].to(cdt)
        vmask = valid[sl]
        kv_rows = gather_valid_rows(kvf, rows[sl], vmask, cdt)
        scores = _chunk_scores(qc, kv_rows, vmask, scale)
        norm = _normaliser(lsef[sl], z)  # +inf for empty rows
        p = _slot_probs(scores, norm, vmask)
        if probs is not None:
            probs[sl] = p.sum(1)
        do = doutf[sl].to(cdt)
        empty = ~vmask.any(-1, keepdim=True)  # [c, 1]
        delta = torch.where(empty, 0.0, (outf[sl].to(cdt) * do).sum(-1))  # [c, H]; empty rows give nothing
        dp = torch.einsum("chd,ckd->chk", do, kv_rows[..., :dv])
        ds = torch.where(vmask.unsqueeze(1), p * (dp - delta.unsqueeze(-1)), 0.0)
        dq[sl] = (torch.einsum("chk,ckd->chd", ds, kv_rows) * scale).to(q.dtype)
        contrib = torch.einsum("chk,chd->ckd", ds, qc) * scale
        contrib[..., :dv] += torch.einsum("chk,chd->ckd", p, do)
        add_rows_in_order(dkv, rows[sl][vmask], contrib[vmask])
        if dsink is not None:
            p_sink = torch.where(empty, 0.0, torch.exp(z - norm))  # [c, H]
            dsink -= (delta * p_sink).sum(0)
    res = dq.reshape(b, s, h, d), dkv.reshape(b, kv.shape[1], d), dsink
    return res + (probs.reshape(b, s, k),) if return_probs else res


class SparseAttentionReference(torch.autograd.Function):
    """Autograd over the chunked reference; backward recomputes scores chunk by chunk."""

    @staticmethod
    def forward(ctx, q, kv, indices, sink, scale, dv):
        out, lse = sparse_attention_forward(q, kv, indices, scale, sink, dv)
        ctx.save_for_backward(q, kv, indices, sink, out, lse)
        ctx.scale, ctx.dv = scale, dv
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, kv, indices, sink, out, lse = ctx.saved_tensors
        dq, dkv, dsink = sparse_attention_backward(q, kv, indices, out, lse, dout, ctx.scale, sink, ctx.dv)
        dsink = None if dsink is None else dsink.to(sink.dtype)
        return dq, dkv.to(kv.dtype), None, dsink, None, None


def sparse_attention_reference(q, kv, indices, scale: float, sink=None, dv: int | None = None):
    """Differentiable reference: (out [B,S,H,dv], lse [B,S,H]); gradients for q, kv and sink."""
    return SparseAttentionReference.apply(q, kv, indices, sink, scale, dv)


def sparse_attention_dense(q, kv, indices, scale: float, sink=None, dv: int | None = None):
    """Naive dense formulation (a [B,S,H,Skv] score matrix with a count mask), for tests only.

    Independent of the chunked code: slot multiplicities become log-counts added to the scores.
    """
    b, s, h, d = q.shape
    skv = kv.shape[1]
    dv = d if dv is None else dv
    idx = indices.long()
    valid = (idx >= 0) & (idx < skv)
    counts = torch.zeros(b, s, skv, dtype=q.dtype, device=q.device)
    counts.scatter_add_(2, idx.clamp(0, max(skv - 1, 0)), valid.to(q.dtype))
    empty = (counts.sum(-1) == 0).unsqueeze(-1).expand(b, s, h)  # [B, S, H]
    scores = torch.einsum("bshd,btd->bsht", q, kv) * scale + torch.log(counts).unsqueeze(2)
    scores = torch.where(empty.unsqueeze(-1), torch.zeros_like(scores), scores)  # keep autograd finite
    lse = torch.logsumexp(scores, dim=-1)
    norm = lse if sink is None else torch.logaddexp(lse, sink.to(q.dtype))
    p = torch.where(empty.unsqueeze(-1), torch.zeros_like(scores), torch.exp(scores - norm.unsqueeze(-1)))
    out = torch.einsum("bsht,btd->bshd", p, kv[..., :dv])
    return out, torch.where(empty, torch.full_like(lse, float("inf")), lse)
