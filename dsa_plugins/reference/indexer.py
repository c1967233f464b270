"""Torch reference of the lightning indexer and top-k (DSA.md 1.2): the oracle and the CPU path.

    I[t, s] = sum_h relu(<index_q[t, h], index_k[s]>) * weights[t, h]     for key_start[t] <= s < key_end[t]

Keys are global rows of ``index_k``; a query's window ``[key_start, key_end)`` encodes causality,
sequence boundaries (varlen), context-parallel shards and padding. Queries are processed in
chunks over the span of keys their windows cover, so memory is O(chunk * span), never O(T * T)
for the whole batch.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMS = 1 << 26  # elements of the [chunk, Hi, span] product one chunk may hold


def causal_key_windows(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    query_indices: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal key windows for packed (THD) sequences.

    cu_seqlens [N+1]: cumulative real lengths. cu_seqlens_padded [N+1] (optional): offsets of the
    sequences in the padded token layout (context parallel pads each sequence); token positions and
    key rows are then in that layout, and padding keys are excluded. query_indices (optional): the
    global (padded-layout) positions of the local query rows (a CP shard). num_tokens: tokens in the
    layout (default: the last offset; passing it avoids a device->host sync).

    Returns (key_start, key_end) int32: query at position p sees keys [start, min(p + 1, real_end)).
    Padding positions (p >= real_end) see the whole real sequence; a position outside every
    sequence sees no key.
    """
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_seqlens_padded", cu_seqlens_padded)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() == 0):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 1-D tensor of N + 1 cumulative offsets (N >= 0), got {got}")
    cu = cu_seqlens.to(torch.int64)
    offsets = cu if cu_seqlens_padded is None else cu_seqlens_padded.to(device=cu.device, dtype=torch.int64)
    if offsets.shape != cu.shape:
        raise ValueError(
            f"cu_seqlens_padded must have the shape of cu_seqlens {tuple(cu.shape)}, got {tuple(offsets.shape)}"
        )
    total = int(offsets[-1].item()) if num_tokens is None else int(num_tokens)
    if query_indices is None:
        pos = torch.arange(total, device=cu.device, dtype=torch.int64)
    else:
        pos = query_indices.reshape(-1).to(device=cu.device, dtype=torch.int64)
    seq = (torch.searchsorted(offsets, pos, right=True) - 1).clamp(0, offsets.numel() - 2)
    start = offsets[seq]
    real_end = start + (cu[1:] - cu[:-1])[seq]
    end = torch.minimum(pos + 1, real_end)
    end = torch.where(pos >= real_end, real_end, end)
    outside = (pos < offsets[0]) | (pos >= offsets[-1])
    end = torch.where(outside, start, end)
    return start.to(torch.int32), end.to(torch.int32)


def indexer_scores(index_q, index_k, weights, key_start=None, key_end=None, key_lo: int = 0, key_hi: int | None = None,
                   index_k_scale=None):
    """Scores [Tq, key_hi - key_lo] in float32 (float64 for float64 inputs) over keys [key_lo, key_hi),
    -inf outside each query's window; times index_k_scale[s] when given (fp8 keys)."""
    cdt = torch.float64 if index_q.dtype == torch.float64 else torch.float32
    key_hi = index_k.shape[0] if key_hi is None else key_hi
    keys = index_k[key_lo:key_hi].to(cdt)
    logits = torch.einsum("thd,sd->ths", index_q.to(cdt), keys).clamp_min(0)
    scores = torch.einsum("ths,th->ts", logits, weights.to(cdt))
    if index_k_scale is not None:
        scores = scores * index_k_scale[key_lo:key_hi].to(cdt)[None, :]
    if key_start is not None:
        cols = torch.arange(key_lo, key_hi, device=scores.device)
        inside = (cols >= key_start.unsqueeze(1).long()) & (cols < key_end.unsqueeze(1).long())
        scores = scores.masked_fill(~inside, float("-inf"))
    return scores


def topk_rows_reference(scores: torch.Tensor, lengths: torch.Tensor | None, topk: int) -> torch.Tensor:
    """Column indices [R, topk] int32 of the topk largest valid scores per row, -1 padded.

    Valid columns of row r are 0..lengths[r]-1 (all when lengths is None). Sorted by score,
    descending. Ties (DSA.md 2): among equal scores the lowest column wins, and -0.0 ties with +0.0,
    so a row's selection depends on its own scores only (``torch.topk`` promises no order among
    ties: a stable sort does). Which columns NaN scores take is unspecified.
    """
    r, n = scores.shape
    s = scores.float() if scores.dtype != torch.float64 else scores
    s = s + 0.0  # -0.0 + 0.0 == +0.0: zero scores of either sign are one value
    if lengths is not None:
        cols = torch.arange(n, device=scores.device)
        s = s.masked_fill(cols.unsqueeze(0) >= lengths.unsqueeze(1).long(), float("-inf"))
    k_eff = min(topk, n)
    out = torch.full((r, topk), -1, dtype=torch.int32, device=scores.device)
    if k_eff == 0:
        return out
    vals, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :k_eff], idx[:, :k_eff]
    out[:, :k_eff] = torch.where(torch.isneginf(vals), -1, idx).to(torch.int32)
    return out


def selected_lse(scores: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row's scores at its selected columns: scores [R, W], cols [R, k] (< 0: no
    column). Returns [R] fp32, -inf for a row without a column (the indexer loss's lse(I), DSA.md 1.2)."""
    picked = scores.gather(1, cols.clamp_min(0).long())
    return torch.logsumexp(picked.float().masked_fill(cols < 0, float("-inf")), dim=1)


def indexer_topk_reference(index_q, index_k, weights, topk: int, key_start, key_end, index_k_scale=None,
                           return_lse: bool = False):
    """[Tq, topk] int32 global key rows of the topk largest scores in each window, sorted by score
    descending (ties: the lowest row first), -1 where the window holds fewer than topk keys.
    index_k_scale [Tk]: per-key scales of fp8 keys (see indexer_scores). return_lse: also the
    logsumexp of each row's selected scores ([Tq] fp32, -inf for an empty row): (rows, lse)."""
    tq, hi, _ = index_q.shape
    out = torch.full((tq, topk), -1, dtype=torch.int32, device=index_q.device)
    lse = torch.full((tq,), float("-inf"), dtype=torch.float32, device=index_q.device)
    if tq == 0:
        return (out, lse) if return_lse else out
    starts, ends = key_start.long(), key_end.long()
    # One host sync per call for the key spans; acceptable for the reference path.
    lo_all, hi_all = starts.cpu(), ends.cpu()
    t = 0
    while t < tq:
        # grow the chunk while its [rows, Hi, span] product fits the budget
        c = 1
        lo, hi_ = int(lo_all[t]), int(hi_all[t])
        while t + c < tq:
            nlo, nhi = min(lo, int(lo_all[t + c])), max(hi_, int(hi_all[t + c]))
            if (c + 1) * hi * max(nhi - nlo, 1) > _CHUNK_ELEMS:
                break
            lo, hi_, c = nlo, nhi, c + 1
        sl = slice(t, t + c)
        if hi_ > lo:
            scores = indexer_scores(index_q[sl], index_k, weights[sl], starts[sl], ends[sl], lo, hi_, index_k_scale)
            local = topk_rows_reference(scores, None, topk)
            out[sl] = torch.where(local >= 0, local + lo, local)
            if return_lse:
                lse[sl] = selected_lse(scores, local)
        t += c
    return (out, lse) if return_lse else out


def quantize_fp8_rows(x: torch.Tensor, name: str = "x", check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantisation over the last dim: (x8 float8_e4m3fn, scale float32 [...]) with
    x ~= x8 * scale[..., None]; scale = amax / 448 (1 for all-zero rows, at least the smallest
    normal float). Non-finite values raise a ValueError naming ``name`` (one device sync);
    ``check_finite=False`` skips that check (no sync: graph capture); such a row's quantised values,
    and so its scores, are then non-finite."""
    amax = x.float().abs().amax(-1)
    if check_finite and not bool(torch.isfinite(amax).all()):
        raise ValueError(f"{name} has non-finite values (NaN or inf): it cannot be quantised to fp8")
    scale = torch.where(amax > 0, (amax / 448.0).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    x8 = (x.float() / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return x8, scale
