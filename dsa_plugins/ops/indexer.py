"""Lightning indexer + top-k, standalone top-k and the indexer KL loss: public ops.

indexer_topk works on key *windows*: query t may see the global key rows
``key_start[t] <= s < key_end[t]`` of index_k. Causality, sequence boundaries (varlen THD),
context-parallel shards and padding all reduce to windows; ``causal_key_windows`` builds them
from cu_seqlens (and cu_seqlens_padded / query_indices).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.settings import check_indices_enabled, deterministic_enabled, resolve_backend
from ..common.indices import as_int32
from ..common.validation import FLOAT_DTYPES, FP8_DTYPES, INDEX_DTYPES, check_index_range, check_scale, check_tensor
from ..kernels import load_kernel
from ..reference.indexer import causal_key_windows, indexer_topk_reference, quantize_fp8_rows, topk_rows_reference
from ..reference.indexer_loss import indexer_kl_loss_reference
from .backend import autocast_floats, choose_kernel, direct_call_ok, kernel_shape_reason

__all__ = [
    "causal_key_windows",
    "indexer_kl_loss",
    "indexer_topk",
    "quantize_indexer_fp8",
    "tilelang_indexer_topk",
    "topk_rows",
]


def _run_indexer_topk(index_q, index_k, weights, key_start, key_end, topk, backend, index_k_scale, rows_per_entry,
                      keys_per_entry, return_lse):
    """The body of both indexer top-k custom ops: the kernels by the backend rules, else the reference.
    rows_per_entry / keys_per_entry > 0: the rows come from a batched layout whose windows count each entry's
    own keys ([T], or [rows_per_entry] shared by the entries), and the result holds the entries' own columns
    (see _batched_indexer_topk)."""
    reason = kernel_shape_reason("indexer_topk", num_heads=index_q.shape[1], head_dim=index_q.shape[2], topk=topk,
                                 dtype=index_q.dtype)
    batched = rows_per_entry > 0
    if choose_kernel(backend, "indexer_topk", (index_q, index_k), reason):
        # the kernels' plan program clamps the windows, moves them to the entries' keys and writes the entries'
        # own columns: no torch launches before or after it
        return load_kernel("indexer_topk")(index_q, index_k, weights, key_start, key_end, topk,
                                           index_k_scale=index_k_scale,
                                           entries=(rows_per_entry, keys_per_entry) if batched else None,
                                           return_lse=return_lse, entry_windows=batched)
    # the reference takes global windows, clamped (as the kernels clamp them)
    if not batched:
        start, end = _windows_within_keys(key_start, key_end, index_k.shape[0])
        return indexer_topk_reference(index_q, index_k, weights, topk, start, end, index_k_scale,
                                      return_lse=return_lse)
    rows = index_q.shape[0]
    first = (torch.arange(rows, device=index_q.device, dtype=torch.int32) // rows_per_entry) * keys_per_entry
    start, end = _windows_within_keys(key_start, key_end, keys_per_entry)
    if start.shape[0] != rows:  # one set of windows for every entry
        start, end = start.repeat(rows // rows_per_entry), end.repeat(rows // rows_per_entry)
    result = indexer_topk_reference(index_q, index_k, weights, topk, start + first, end + first, index_k_scale,
                                    return_lse=return_lse)
    picked = result[0] if return_lse else result
    picked = torch.where(picked >= 0, picked - first[:, None], picked)
    return (picked, result[1]) if return_lse else picked


@torch.library.custom_op("dsa_plugins::indexer_topk", mutates_args=())
def _indexer_topk_op(
    index_q: Tensor, index_k: Tensor, weights: Tensor, key_start: Tensor, key_end: Tensor, topk: int, backend: str,
    index_k_scale: Tensor | None = None, rows_per_entry: int = 0, keys_per_entry: int = 0,
) -> Tensor:
    return _run_indexer_topk(index_q, index_k, weights, key_start, key_end, topk, backend, index_k_scale,
                             rows_per_entry, keys_per_entry, False)


@_indexer_topk_op.register_fake
def _(index_q, index_k, weights, key_start, key_end, topk, backend, index_k_scale=None, rows_per_entry=0,
      keys_per_entry=0):
    return index_q.new_empty(index_q.shape[0], topk, dtype=torch.int32)


@torch.library.custom_op("dsa_plugins::indexer_topk_lse", mutates_args=())
def _indexer_topk_lse_op(
    index_q: Tensor, index_k: Tensor, weights: Tensor, key_start: Tensor, key_end: Tensor, topk: int, backend: str,
    index_k_scale: Tensor | None = None, rows_per_entry: int = 0, keys_per_entry: int = 0,
) -> tuple[Tensor, Tensor]:
    # indexer_topk plus the logsumexp of each row's selected scores (the indexer loss's lse(I))
    return _run_indexer_topk(index_q, index_k, weights, key_start, key_end, topk, backend, index_k_scale,
                             rows_per_entry, keys_per_entry, True)


@_indexer_topk_lse_op.register_fake
def _(index_q, index_k, weights, key_start, key_end, topk, backend, index_k_scale=None, rows_per_entry=0,
      keys_per_entry=0):
    return (index_q.new_empty(index_q.shape[0], topk, dtype=torch.int32),
            index_q.new_empty(index_q.shape[0], dtype=torch.float32))


def quantize_indexer_fp8(index_q: Tensor, index_k: Tensor, weights: Tensor,
                         check_finite: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp8 inputs for :func:`indexer_topk`, as DeepSeek-V3.2 inference quantises them.

    index_q [T, Hi, Di] and index_k [Tk, Di] (any float dtype) get one e4m3 scale per (token, head)
    and per key row (amax / 448); the query scales fold into the weights, since
    relu(a * x) = a * relu(x) for a > 0. Returns (index_q fp8 [T,Hi,Di], index_k fp8 [Tk,Di],
    index_k_scale fp32 [Tk], weights fp32 [T,Hi]) to pass as indexer_topk(q8, k8, w8, ...,
    index_k_scale=...). The scores are those of the quantised values: near-ties may change order.
    Non-finite values raise a ValueError (one device sync); ``check_finite=False`` skips the check (graph
    capture), and their scores are then non-finite.
    """
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("index_k", index_k, ndim=2, dtypes=FLOAT_DTYPES, device=index_q.device, shape={1: index_q.shape[2]})
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=index_q.device,
                 shape={0: index_q.shape[0], 1: index_q.shape[1]})
    q8, q_scale = quantize_fp8_rows(index_q, "index_q", check_finite)
    k8, k_scale = quantize_fp8_rows(index_k, "index_k", check_finite)
    return q8, k8, k_scale, (weights.float() * q_scale).contiguous()


def _check_windows(key_start, key_end, tq: int, tk: int, device, range_checked: bool = False) -> tuple[Tensor, Tensor]:
    """``range_checked``: the caller has range-checked the windows already (the batched layout, in its entries'
    own columns): no second check, and no second host sync. ``tq``: the windows' length."""
    for name, t in (("key_start", key_start), ("key_end", key_end)):
        check_tensor(name, t, ndim=1, dtypes=INDEX_DTYPES, device=device, shape={0: tq}, unit_stride=False)
    if check_indices_enabled() and not range_checked:
        check_index_range("key_start", key_start, tk + 1)
        check_index_range("key_end", key_end, tk + 1)
    # wider integers clamped before the cast (2**32 + j must not wrap onto j); int32 bounds as they are (no launch)
    return as_int32(key_start, tk).contiguous(), as_int32(key_end, tk).contiguous()


def _windows_within_keys(key_start: Tensor, key_end: Tensor, tk: int) -> tuple[Tensor, Tensor]:
    """Each window clamped to the keys [0, tk], start <= end (what the kernels do themselves)."""
    end = key_end.clamp(0, tk)
    return torch.minimum(key_start.clamp(0, tk), end), end


def indexer_topk(
    index_q: Tensor, index_k: Tensor, weights: Tensor, topk: int, key_start: Tensor, key_end: Tensor,
    backend: str | None = None, index_k_scale: Tensor | None = None, return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Top-k keys of the lightning indexer within each query's window.

    Packed: index_q [T, Hi, Di] bf16 (rope applied); index_k [Tk, Di] same dtype; weights [T, Hi] float32
    with the softmax scale folded in (weights_proj(x) * Hi**-0.5 * Di**-0.5); key_start/key_end [T] int32
    (windows of global rows of index_k). Batched: index_q [B, S, Hi, Di], index_k [B, Tk, Di], weights
    [B, S, Hi], key_start/key_end [B, S] (or [S], shared by the batch) windows of each batch entry's own
    key columns (index_k_scale [B, Tk]); returns [B, S, topk] key columns of the row's batch entry.
    Score I[t, s] = sum_h relu(<index_q[t,h], index_k[s]>) * weights[t,h].
    fp8 (inference): index_q and index_k float8_e4m3fn, index_k_scale [Tk] float32 positive per-key scales
    (required; the score of key s is multiplied by it; per-query scales go into weights); see
    quantize_indexer_fp8. Non-finite inputs give unspecified selections.
    Returns [T, topk] int32 global rows of index_k; -1 where the window has fewer than topk keys (a row whose
    window holds at most topk keys takes all of them; the kernels do not score it unless return_lse asks).
    Among equal scores the lowest row wins (-0.0 ties with +0.0), on every backend, so a row's
    selection does not depend on batching, padding, chunking or context-parallel shards. The TileLang
    path returns each row in ascending key order, -1 last (so the attention's bits do not depend on
    batching either); the torch path by score, descending (compare as sets across backends). Inside torch.autocast, float32
    index_q and index_k are scored in the autocast dtype (weights stay float32).
    return_lse=True: returns (rows, lse), lse [T] (batched: [B, S]) float32 the logsumexp of each row's
    selected scores (-inf for a row without a key): pass it to the sparse indexer KL loss
    (``indexer_kl_loss(..., index_lse=lse)`` or ``FusedIndexerLoss(..., index_lse=lse)``), which then
    skips its own pass over the logits.
    """
    index_q, index_k = autocast_floats(index_q, index_k)
    check_tensor("index_q", index_q, ndim=(3, 4), dtypes=FLOAT_DTYPES + FP8_DTYPES)
    if index_q.dim() == 4:
        return _batched_indexer_topk(index_q, index_k, weights, topk, key_start, key_end, backend, index_k_scale,
                                     return_lse)
    return _packed_indexer_topk(index_q, index_k, weights, topk, key_start, key_end, backend, index_k_scale,
                                return_lse=return_lse)


def _packed_indexer_topk(index_q, index_k, weights, topk, key_start, key_end, backend, index_k_scale,
                         entries: tuple[int, int] = (0, 0), return_lse: bool = False):
    """The packed layout: checks, then the custom op. ``entries`` (rows, keys) per batch entry when the
    rows come from the batched layout (windows of each entry's own keys, [T] or [rows] shared by the entries,
    already range-checked; the result in the entries' own columns), else (0, 0)."""
    device = index_q.device
    tq, hi, di = index_q.shape
    check_tensor("index_k", index_k, ndim=2, dtypes=(index_q.dtype,), device=device, shape={1: di})
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape={0: tq, 1: hi})
    if index_q.dtype in FP8_DTYPES:
        if index_k_scale is None:
            raise ValueError("index_k_scale [Tk] is required with float8_e4m3fn index_q/index_k (the per-key scales "
                             "of quantize_indexer_fp8; pass ones for unscaled keys)")
        check_tensor("index_k_scale", index_k_scale, ndim=1, dtypes=FLOAT_DTYPES, device=device,
                     shape={0: index_k.shape[0]}, unit_stride=False)
        index_k_scale = index_k_scale.float().contiguous()
        if check_indices_enabled() and not bool(((index_k_scale > 0) & index_k_scale.isfinite()).all()):
            raise ValueError("index_k_scale must be positive and finite (DSA_PLUGINS_CHECK_INDICES=1 checks it)")
    elif index_k_scale is not None:
        raise ValueError(f"index_k_scale goes with float8_e4m3fn index_q/index_k, got {index_q.dtype}")
    topk = int(topk)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    batched = entries != (0, 0)
    n_windows = key_start.shape[0] if batched and key_start.dim() == 1 and key_start.shape[0] == entries[0] else tq
    key_start, key_end = _check_windows(key_start, key_end, n_windows, entries[1] if batched else index_k.shape[0],
                                        device, range_checked=batched)
    weights = weights.float() if weights.dtype != torch.float64 else weights
    args = (index_q.contiguous(), index_k.contiguous(), weights.contiguous(), key_start, key_end, topk,
            resolve_backend(backend), index_k_scale, *entries)
    if direct_call_ok(*args[:5], index_k_scale):  # eager: the custom op's body without the dispatcher
        return _run_indexer_topk(*args, return_lse)
    op = torch.ops.dsa_plugins.indexer_topk_lse if return_lse else torch.ops.dsa_plugins.indexer_topk
    return op(*args)


def _batched_indexer_topk(index_q, index_k, weights, topk, key_start, key_end, backend, index_k_scale,
                          return_lse: bool = False):
    """The batched layout through the packed one: batch entry b's keys become rows b * Tk + j."""
    b, s, hi, di = index_q.shape
    device = index_q.device
    check_tensor("index_k", index_k, ndim=3, dtypes=(index_q.dtype,), device=device, shape={0: b, 2: di})
    check_tensor("weights", weights, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape={0: b, 1: s, 2: hi})
    tk = index_k.shape[1]
    for name, t in (("key_start", key_start), ("key_end", key_end)):
        check_tensor(name, t, ndim=(1, 2), dtypes=INDEX_DTYPES, device=device, shape={-1: s}, unit_stride=False)
        if t.dim() == 2:
            check_tensor(name, t, shape={0: b})
    if index_k_scale is not None:
        check_tensor("index_k_scale", index_k_scale, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape={0: b, 1: tk},
                     unit_stride=False)
    if check_indices_enabled():  # the opt-in strict mode: windows outside the entry's keys are an error, any batch
        for name, t in (("key_start", key_start), ("key_end", key_end)):
            check_index_range(name, t, tk + 1)
    # the windows as they are, in each entry's own columns ([B * S], or [S] shared by the entries): the op moves
    # them to the packed keys and returns the entries' own columns itself (no launches around it)
    shared = key_start.dim() == 1 and key_end.dim() == 1 and b > 1
    start = key_start if shared else key_start.expand(b, s).reshape(-1)
    end = key_end if shared else key_end.expand(b, s).reshape(-1)
    result = _packed_indexer_topk(
        index_q.reshape(b * s, hi, di), index_k.reshape(b * tk, di), weights.reshape(b * s, hi), topk,
        start, end, backend,
        None if index_k_scale is None else index_k_scale.reshape(b * tk), entries=(s, tk), return_lse=return_lse,
    )
    rows = result[0] if return_lse else result
    rows = rows.view(b, s, rows.shape[-1])  # (b, s, -1) is ambiguous without rows
    return (rows, result[1].view(b, s)) if return_lse else rows


def tilelang_indexer_topk(
    index_q: Tensor,
    index_k: Tensor,
    head_weights: Tensor,
    cu_seqlens: Tensor,
    index_topk: int,
    query_indices: Tensor | None = None,
    cu_seqlens_padded: Tensor | None = None,
    index_k_scale: Tensor | None = None,
) -> Tensor:
    """Fused indexer top-k on packed (THD) sequences (NeMo AutoModel name).

    index_q [T, Hi, Di] bf16; index_k [Tk, Di] bf16 (all tokens; with context parallelism the
    all-gathered keys in global order); head_weights [T, Hi] fp32 (scale folded in);
    cu_seqlens [N+1]; query_indices [T] global positions of the local query rows (CP shard);
    cu_seqlens_padded [N+1] offsets in the padded layout (CP padding keys excluded);
    index_k_scale [Tk] with float8_e4m3fn index_q/index_k (see indexer_topk).
    Returns [T, 1, index_topk] int32 global rows of index_k, -1 where fewer keys are visible.
    """
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
    tk = index_k.shape[0]
    if query_indices is None and index_q.shape[0] != tk:
        raise ValueError(
            f"index_q has {index_q.shape[0]} rows and index_k {tk}: pass query_indices for a shard of queries"
        )
    start, end = causal_key_windows(
        cu_seqlens.to(index_q.device), None if cu_seqlens_padded is None else cu_seqlens_padded.to(index_q.device),
        None if query_indices is None else query_indices.to(index_q.device), num_tokens=tk,
    )
    return indexer_topk(index_q, index_k, head_weights, index_topk, start, end,
                        index_k_scale=index_k_scale).unsqueeze(1)


def topk_rows(scores: Tensor, lengths: Tensor | None, topk: int, backend: str | None = None) -> Tensor:
    """Exact top-k per row: scores [R, N] float32, lengths [R] int32 (valid columns 0..len-1) or None.
    Returns [R, topk] int32 column indices, -1 padded: ascending on the TileLang path, by score
    (descending) on the torch path."""
    check_tensor("scores", scores, ndim=2, dtypes=FLOAT_DTYPES)
    if lengths is not None:
        check_tensor("lengths", lengths, ndim=1, dtypes=INDEX_DTYPES, device=scores.device, shape={0: scores.shape[0]})
        lengths = as_int32(lengths, scores.shape[1]).contiguous()  # no int64 wrap
    topk = int(topk)
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if choose_kernel(resolve_backend(backend), "topk_rows", (scores,)):
        return load_kernel("topk_rows")(scores.contiguous(), lengths, topk)
    return topk_rows_reference(scores, lengths, topk)


def indexer_kl_loss(
    index_q: Tensor, index_k: Tensor, weights: Tensor, q: Tensor, kv: Tensor, attn_lse: Tensor | None,
    scale: float, topk_indices: Tensor | None = None, key_start: Tensor | None = None,
    key_end: Tensor | None = None, sink: Tensor | None = None, backend: str | None = None,
    row_weights: Tensor | None = None, index_lse: Tensor | None = None,
) -> Tensor:
    """DeepSeek-V3.2 indexer loss KL(p_attn || softmax(I)), mean over query rows (packed layout).

    index_q [T, Hi, Di], index_k [Tk, Di], weights [T, Hi]: the indexer's outputs (gradients flow
    to these only). q [T, H, Dqk], kv [Tk, Dqk] (or [Tk, 1, Dqk]): the attention inputs (detached
    here: the caller detaches the indexer's inputs from the main model). attn_lse [T, H] or None
    (then the normaliser is recomputed over the same slots). Sparse stage: topk_indices [T, k]
    (or [T, 1, k]) global rows, -1 = none. Dense warm-up: key_start/key_end [T] windows instead.
    sink [H] (optional): the attention's per-head sink, included in the normaliser.
    row_weights [T] (optional): each row's factor in place of the mean's 1 / T (e.g. 1 / n_real on
    real rows and 0 on padding, or 1 for a per-token sum).
    Both stages run on the TileLang kernels (bf16, Hopper) by the backend rules, else on the torch
    reference; the dense warm-up loss goes through the kernels blockwise in chunks of rows
    (``kernels.indexer_loss.indexer_kl_loss_dense``), never [T, T] at once.
    Inside torch.autocast, float32 index_q, index_k, q and kv run in the autocast dtype.
    index_lse [T] (sparse stage, optional): the logsumexp of each row's selected indexer scores, as
    ``indexer_topk(..., return_lse=True)`` returns it; the kernels then skip their own pass over the
    logits (the torch reference recomputes it).
    """
    index_q, index_k, q, kv = autocast_floats(index_q, index_k, q, kv)
    check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
    device = index_q.device
    t, hi, di = index_q.shape
    check_tensor("index_k", index_k, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape={1: di})
    check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape={0: t, 1: hi})
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, device=device, shape={0: t})
    check_tensor("kv", kv, ndim=(2, 3), dtypes=FLOAT_DTYPES, device=device)
    if kv.dim() == 3:
        kv = kv.squeeze(1)
    if kv.shape[0] != index_k.shape[0] or kv.shape[1] != q.shape[2]:
        raise ValueError(f"kv must be [Tk={index_k.shape[0]}, Dqk={q.shape[2]}], got {tuple(kv.shape)}")
    if attn_lse is not None:
        check_tensor("attn_lse", attn_lse, ndim=2, dtypes=FLOAT_DTYPES, device=device, shape={0: t, 1: q.shape[1]})
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape={0: q.shape[1]})
    scale = check_scale(scale)
    if topk_indices is not None:
        check_tensor("topk_indices", topk_indices, ndim=(2, 3), dtypes=INDEX_DTYPES, device=device, shape={0: t})
        topk_indices = topk_indices.reshape(t, topk_indices.shape[-1])  # (t, -1) is ambiguous for T 0
        if check_indices_enabled():
            check_index_range("topk_indices", topk_indices, kv.shape[0])
        # out-of-range rows are "no key", as everywhere (clamped before the int32 cast)
        topk_indices = as_int32(topk_indices, kv.shape[0])
        topk_indices = torch.where(topk_indices < kv.shape[0], topk_indices, -1)
    else:
        if key_start is None or key_end is None:
            raise ValueError("indexer_kl_loss needs topk_indices (sparse) or key_start and key_end (dense)")
        key_start, key_end = _check_windows(key_start, key_end, t, kv.shape[0], device)
        # each window clamped to the keys, as indexer_topk's (a start of -1 must not reach row -1, the last key)
        key_start, key_end = _windows_within_keys(key_start, key_end, kv.shape[0])
    reason = kernel_shape_reason("indexer_kl_loss", num_heads=q.shape[1], dqk=q.shape[2],
                                 index_heads=index_q.shape[1], index_dim=index_q.shape[2], dtype=index_q.dtype)
    if row_weights is not None:
        check_tensor("row_weights", row_weights, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape={0: t})
    if index_lse is not None:
        if topk_indices is None:
            raise ValueError("index_lse goes with topk_indices (the sparse stage): the dense warm-up's windows have "
                             "no top-k scores")
        check_tensor("index_lse", index_lse, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape={0: t})
        index_lse = index_lse.detach().float().contiguous()
    if choose_kernel(resolve_backend(backend), "indexer_kl_loss", (index_q, index_k, q, kv), reason):
        return _IndexerKLLossKernel.apply(
            index_q, index_k, weights.float(), q.detach(), kv.detach(),
            None if attn_lse is None else attn_lse.detach().float(),
            None if topk_indices is None else topk_indices.contiguous(), key_start, key_end,
            scale, None if sink is None else sink.detach().float(),
            None if row_weights is None else row_weights.detach().float(), deterministic_enabled(), index_lse,
        )
    return indexer_kl_loss_reference(
        index_q, index_k, weights, q, kv, attn_lse, scale, topk_indices, key_start, key_end, sink,
        row_weights=row_weights,
    )


class _IndexerKLLossKernel(torch.autograd.Function):
    """Indexer KL loss through the TileLang kernels: per-row losses, weighted sum over rows (the
    mean's 1 / T unless row weights are given). The kernels yield the gradients in the same
    call as the value, so the forward keeps them and the backward only scales them. Sparse: the
    loss program over the top-k slots. Dense: the blockwise dense programs over the windows (the
    normaliser, when not given, recomputed over the same keys: the dense attention's)."""

    @staticmethod
    def forward(ctx, index_q, index_k, weights, q, kv, attn_lse, topk_indices, key_start, key_end, scale, sink,
                row_weights, deterministic, index_lse=None):
        t = index_q.shape[0]
        wants_grad = any(ctx.needs_input_grad[:3])
        factor = row_weights if row_weights is not None else torch.full((t,), 1.0 / max(t, 1), device=index_q.device)
        grad_rows = factor if wants_grad else None
        if topk_indices is not None:
            rows, grads = load_kernel("indexer_kl_loss")(
                index_q.contiguous(), index_k.contiguous(), weights.contiguous(), q.contiguous(), kv.contiguous(),
                attn_lse, topk_indices, scale, sink, grad_rows=grad_rows, deterministic=deterministic,
                index_lse=index_lse,
            )
        else:  # reproducible in either mode (no atomics)
            rows, grads = load_kernel("indexer_kl_loss_dense")(
                index_q.contiguous(), index_k.contiguous(), weights.contiguous(), q.contiguous(), kv.contiguous(),
                attn_lse, key_start, key_end, scale, sink, grad_rows=grad_rows,
            )
        ctx.grads = grads
        ctx.dtypes = (index_q.dtype, index_k.dtype, weights.dtype)
        return (rows * factor).sum()

    @staticmethod
    def backward(ctx, grad):
        d_iq, d_ik, d_w = ctx.grads
        ctx.grads = None
        g = grad.float()
        dt_q, dt_k, dt_w = ctx.dtypes
        # a 0-dim fp32 factor: one kernel per gradient, computed in fp32 and rounded once to the result's dtype
        return tuple(d.mul(g).to(dt) for d, dt in ((d_iq, dt_q), (d_ik, dt_k), (d_w, dt_w))) + (None,) * 11
