"""Indexer top-k through the fused ``indexer_topk`` op, shared by every model family.

The models' own indexers build ``[B, S, T]`` fp32 scores and take their top-k; here the scores
never exist: each query row's visible keys form a window ``[start, end)`` of key columns, and the
fused op (``ops.indexer_topk`` in its batched layout) returns the top-k inside it.
:func:`select_topk` is the shared tail of the V3.2 family's indexers (cache, windows, mask).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ... import ops
from ...common.settings import warn_once
from ...reference.indexer import indexer_scores, selected_lse, topk_rows_reference
from .binding import CallBinder
from .cache import check_index_key_format, update_fp8_index_keys
from .index_keys import fp8_index_cache_enabled, quantize_index_inputs
from .masks import LazyMask, as_mask, mask_indices

__all__ = ["indexer_binder", "indexer_cache", "select_topk"]

# The indexer's cache argument: ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24 (the
# old name still accepted through ``deprecate_kwarg`` until 5.40).
_CACHE_NAMES = ("cache", "past_key_values")

# up to this many query rows per sequence, a padded batch's selection is masked without first
# asking (on the host) whether the padding has holes
_ALWAYS_MASK_ROWS = 64


def indexer_binder(forward: Callable) -> CallBinder:
    """Binder of a model's indexer ``forward``, accepting the cache under either name."""
    return CallBinder(forward, aliases=_CACHE_NAMES)


def indexer_cache(bound: dict):
    """The cache of a bound indexer call (under either name), or None."""
    for name in _CACHE_NAMES:
        if bound.get(name) is not None:
            return bound[name]
    return None


def select_topk(
    indexer, q: torch.Tensor, k_new: torch.Tensor, weights: torch.Tensor, mask: LazyMask, past_key_values,
    return_lse: bool = False,
):
    """Shared tail of every V3.2-family indexer: cache, windows, ``indexer_topk``, mask -> -1.

    q [B, S, Hi, Di] (rope applied), k_new [B, S, Di], weights [B, S, Hi] fp32 with every scale
    folded in. Returns [B, S, min(index_topk, T)] int32 key columns, -1 where none / forbidden.
    ``return_lse`` (the indexer loss): (columns, lse [B * S] fp32 of each row's selected scores, or None
    when the mask is applied: it may take slots away, and the loss then recomputes the lse).
    """
    k_scale = None
    if fp8_index_cache_enabled(indexer):  # opt-in: fp8 scores and an fp8 key cache (index_keys.py)
        if return_lse:
            raise ValueError("dsa_tilelang: the indexer loss trains the bf16 indexer; turn the fp8 index cache off "
                             "for training (dsa_plugins.hf.disable_fp8_index_cache(model))")
        q, k_new, k_scale, weights = quantize_index_inputs(q, k_new, weights)
        if past_key_values is not None:
            k, k_scale = update_fp8_index_keys(past_key_values, indexer.layer_idx, k_new, k_scale)
        else:
            k = k_new
    else:
        if past_key_values is not None:
            check_index_key_format(past_key_values, indexer.layer_idx, fp8=False)
            k = past_key_values.update_indexer(k_new, indexer.layer_idx)
        else:
            k = k_new
        k = k.to(q.dtype)
    B, S = q.shape[:2]
    T = k.shape[1]
    mask = as_mask(mask, B, S, T, q.device)
    start, end = mask.windows()  # 0 <= start <= end <= mask.kv_length
    if mask.kv_length > T:  # a mask over more key columns than the cache holds
        end = end.clamp(max=T)
        start = torch.minimum(start, end)
    topk = min(int(indexer.index_topk), T)
    compiling = torch.compiler.is_compiling()
    # A row whose allowed keys are not one range (padding with gaps, a custom mask) takes its top-k among the
    # allowed keys only, as the models' own indexers do: masking the window's top-k afterwards would leave it
    # fewer keys. Asking reads a flag on the host once per mask (a sync): eager calls ask where there is padding
    # or a custom mask; a compiled graph cannot, and masks the window's selection instead.
    if not compiling and (mask.padding is not None or not mask.is_simple) and mask.has_holes():
        local, lse = _topk_among_allowed(q, k, weights, topk, mask, start, end, return_lse, k_scale)
        return (local, lse) if return_lse else local
    local = ops.indexer_topk(q, k, weights, topk, start, end, index_k_scale=k_scale, return_lse=return_lse)
    lse = None
    if return_lse:
        local, lse = local[0], local[1].reshape(-1)
    # indexer_topk only returns keys inside each row's window, which the mask allows wherever it has no holes; a
    # compiled graph with padding applies the mask (it cannot ask whether there are holes)
    if mask.padding is not None and (S <= _ALWAYS_MASK_ROWS or compiling):
        local, lse = mask_indices(local, mask), None
    return (local, lse) if return_lse else local


def _topk_among_allowed(q, k, weights, topk: int, mask: LazyMask, start, end, return_lse: bool, k_scale=None):
    """[B, S, topk] int32 key columns: each row's top-k among the keys its mask allows (forbidden keys scored
    -inf before the selection), -1 where it allows fewer; with return_lse also the lse [B * S] of the selected
    scores. Dense scores in torch, a few query rows at a time ([rows, Hi, T] at most ~64 M values): the path of
    masks with holes, which the windowed kernel cannot express. The tie rule is indexer_topk's (lowest column).
    ``k_scale`` [B, T]: the per-key scales of fp8 keys."""
    warn_once("hf:indexer_mask_holes", "dsa_tilelang: the attention mask has gaps inside a row (padding between "
              "tokens, or a custom mask): the indexer scores those rows densely in torch, so that each row's top-k "
              "is taken among the keys it may see (slower than the windowed kernel, the same selection rule)")
    B, S, Hi, _ = q.shape
    T = k.shape[1]
    allowed = mask.dense()[:, 0, :, :T]  # [B, S, T]
    out = torch.full((B, S, topk), -1, dtype=torch.int32, device=q.device)
    lse = torch.full((B, S), float("-inf"), dtype=torch.float32, device=q.device) if return_lse else None
    rows = max(1, (1 << 26) // max(1, Hi * T))
    for b in range(B):
        for s0 in range(0, S, rows):
            sl = slice(s0, min(S, s0 + rows))
            scores = indexer_scores(q[b, sl], k[b], weights[b, sl], start[b, sl], end[b, sl],
                                    index_k_scale=None if k_scale is None else k_scale[b])
            scores = scores.masked_fill(~allowed[b, sl], float("-inf"))
            cols = topk_rows_reference(scores, None, topk)
            out[b, sl] = cols
            if lse is not None:
                lse[b, sl] = selected_lse(scores, cols)
    return out, (None if lse is None else lse.reshape(-1))
