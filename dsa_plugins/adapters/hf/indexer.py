"""Indexer top-k through the fused ``indexer_topk`` op, shared by every model family.

The models' own indexers build ``[B, S, T]`` fp32 scores and take their top-k; here the scores
never exist: each query row's visible keys form a window ``[start, end)`` of key columns, and the
fused op (``ops.indexer_topk`` in its batched layout) returns the top-k inside it.
:func:`select_topk` is the shared tail of the V3.2 family's indexers (cache, windows, mask).
"""

from __future__ import annotations

import inspect

import torch

from ... import ops
from .masks import LazyMask, as_mask, mask_indices

__all__ = ["bind_indexer_call", "select_topk"]

# The indexer's cache argument: ``past_key_values`` up to transformers 5.23, ``cache`` from 5.24 (the
# old name still accepted through ``deprecate_kwarg`` until 5.40).
_CACHE_NAMES = ("cache", "past_key_values")


def bind_indexer_call(sig: inspect.Signature, args: tuple, kwargs: dict) -> tuple[dict, object]:
    """Bind a call of a model's indexer ``forward`` to its signature ``sig`` under either name of
    the cache argument: (the bound arguments with defaults, the cache or None)."""
    names = [n for n in _CACHE_NAMES if n in sig.parameters]
    if names:  # a caller may use the other name (a model of the other transformers, a user's code)
        for other in _CACHE_NAMES:
            if other != names[0] and other in kwargs:
                kwargs = dict(kwargs)
                value = kwargs.pop(other)
                kwargs.setdefault(names[0], value)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return a, next((a[n] for n in names if a.get(n) is not None), None)


def select_topk(
    indexer, q: torch.Tensor, k_new: torch.Tensor, weights: torch.Tensor, mask: LazyMask, past_key_values
) -> torch.Tensor:
    """Shared tail of every V3.2-family indexer: cache, windows, ``indexer_topk``, mask -> -1.

    q [B, S, Hi, Di] (rope applied), k_new [B, S, Di], weights [B, S, Hi] fp32 with every scale
    folded in. Returns [B, S, min(index_topk, T)] int32 key columns, -1 where none / forbidden.
    """
    k = past_key_values.update_indexer(k_new, indexer.layer_idx) if past_key_values is not None else k_new
    B, S = q.shape[:2]
    T = k.shape[1]
    mask = as_mask(mask, B, S, T, q.device)
    start, end = mask.windows()
    end = end.clamp(max=T)
    start = torch.minimum(start, end)
    local = ops.indexer_topk(q, k.to(q.dtype), weights, min(int(indexer.index_topk), T), start, end)
    # indexer_topk only returns keys inside each row's window; the mask is needed for holes only
    return mask_indices(local, mask) if mask.has_holes() else local
