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
from .binding import CallBinder
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
    k = past_key_values.update_indexer(k_new, indexer.layer_idx) if past_key_values is not None else k_new
    B, S = q.shape[:2]
    T = k.shape[1]
    mask = as_mask(mask, B, S, T, q.device)
    start, end = mask.windows()  # 0 <= start <= end <= mask.kv_length
    if mask.kv_length > T:  # a mask over more key columns than the cache holds
        end = end.clamp(max=T)
        start = torch.minimum(start, end)
    local = ops.indexer_topk(q, k.to(q.dtype), weights, min(int(indexer.index_topk), T), start, end,
                             return_lse=return_lse)
    lse = None
    if return_lse:
        local, lse = local[0], local[1].reshape(-1)
    # indexer_topk only returns keys inside each row's window; the mask is needed for holes only.
    # Asking whether there are holes reads a flag on the host (a sync, and a break in a compiled
    # graph): generation steps (few rows) and compiled graphs apply the mask instead.
    if (mask.padding is not None and (S <= _ALWAYS_MASK_ROWS or torch.compiler.is_compiling())) or mask.has_holes():
        local, lse = mask_indices(local, mask), None
    return (local, lse) if return_lse else local
