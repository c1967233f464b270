"""The MLA latent in transformers' static cache: one buffer, so that decoding never copies it.

The DSA models of the V3.2 family cache the compressed latent in two halves, ``keys`` [B, 1, T,
kv_lora_rank] and ``values`` [B, 1, T, rope]. The absorbed sparse MLA reads rows of both at once,
so :func:`~.attention.wrap_expand_kv` joined them with ``torch.cat`` on every step: a copy of the
whole cache per layer and token (B 32 x 128K tokens: 4.8 GB read and written per layer-token).
Here the static cache's two halves become column views of one [B, 1, T, rank + rope] buffer, and
:func:`fused_latent` hands that buffer back as the latent without a copy. The values in the cache
are unchanged (eager and sdpa read the same views), so the patch is inert for them.

The indexer's keys in fp8 (opt-in, :func:`~.index_keys.enable_fp8_index_cache`): the cache layer's own
indexer key buffer holds the e4m3 bytes (as uint8, so that transformers' copies, crops and resets apply
to them unchanged) and a second buffer on the layer their per-key scales (:func:`update_fp8_index_keys`);
the layer methods that reorder or repeat the batch rows apply the same to the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ...patches.attributes import patch_attribute
from .constants import PATCH_KEY

__all__ = ["check_index_key_format", "fused_latent", "patch_cache_utils", "update_fp8_index_keys"]


def _wrap_lazy_initialization(original: Callable) -> Callable:
    @functools.wraps(original)
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        original(self, key_states, value_states, *args, **kwargs)
        keys, values = self.keys, self.values
        if keys.dim() != 4 or keys.shape[1] != 1 or keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
            return  # not an MLA latent: leave the cache as transformers made it
        rank = keys.shape[-1]
        latent = keys.new_zeros(*keys.shape[:3], rank + values.shape[-1])
        self.keys, self.values = latent[..., :rank], latent[..., rank:]
        if not torch.compiler.is_compiling():  # as transformers does for its own buffers (cudagraphs)
            for t in (latent, self.keys, self.values):
                torch._dynamo.mark_static_address(t)

    return lazy_initialization


#: on a cache layer with fp8 index keys: their scales [B, T] float32 (T: the key buffer's length)
_SCALE_ATTR = "_dsa_index_key_scale"

#: the layer methods that move whole batch rows of the indexer keys, and the same move for the scales
_SCALE_MOVES = {
    "reorder_cache": lambda s, beam_idx: s.index_select(0, beam_idx.to(s.device)),
    "batch_repeat_interleave": lambda s, repeats: s.repeat_interleave(repeats, dim=0),
    "batch_select_indices": lambda s, indices: s[indices],
}


def _wrap_scale_move(original: Callable, move: Callable) -> Callable:
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        scales = getattr(self, _SCALE_ATTR, None)
        if scales is not None:
            setattr(self, _SCALE_ATTR, move(scales, *args, **kwargs))
        return out

    return method


def patch_cache_utils(module) -> None:
    """Patch ``transformers.cache_utils``: the static cache layer of the DSA models (the one with an
    indexer key cache) keeps its MLA latent in one buffer; the indexed layers' batch moves (beam search,
    expansion, selection) also move the fp8 index keys' scales."""
    key = f"{PATCH_KEY}.cache"
    for name in ("DynamicIndexedLayer", "StaticIndexedLayer"):
        layer = getattr(module, name, None)
        if layer is None:  # a transformers without DSA caches: nothing to do
            continue
        for method, move in _SCALE_MOVES.items():
            if method in vars(layer):
                patch_attribute(layer, method, _wrap_scale_move(getattr(layer, method), move), key=key)
    layer = getattr(module, "StaticIndexedLayer", None)
    if layer is not None:
        patch_attribute(layer, "lazy_initialization", _wrap_lazy_initialization(layer.lazy_initialization), key=key)


def check_index_key_format(cache, layer_idx: int, fp8: bool):
    """Layer ``layer_idx`` of ``cache`` (None if it has none yet), after checking that the index keys it already holds are in the format
    this call adds (fp8 bytes, or the model dtype): a cache filled in one and continued in the other would mix
    them (a dynamic cache would concatenate the fp8 bytes with bf16 keys as numbers). Raises ValueError."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    keys = getattr(layer, "indexer_keys", None)
    if not getattr(layer, "is_indexer_initialized", False) or not isinstance(keys, torch.Tensor):
        return layer
    if (keys.dtype == torch.uint8) != fp8:
        counter = getattr(layer, "indexer_cumulative_length", None)
        if isinstance(counter, torch.Tensor) and int(counter) == 0:
            # a static layer that holds no key (reset: generate reuses its static cache) gets a buffer in the new
            # format at its next update (one host read, only when the format changes)
            layer.indexer_keys, layer.is_indexer_initialized = None, False
            if hasattr(layer, _SCALE_ATTR):
                delattr(layer, _SCALE_ATTR)
            return layer
        held, wanted = ("fp8", "unquantised") if keys.dtype == torch.uint8 else (str(keys.dtype), "fp8")
        raise ValueError(f"the cache's indexer keys of layer {layer_idx} are {held}, and this call adds {wanted} "
                         "keys: switch the fp8 index cache on or off (dsa_plugins.hf.enable_fp8_index_cache / "
                         "disable_fp8_index_cache) between generations, with a new or reset cache")
    return layer


def update_fp8_index_keys(cache, layer_idx: int, keys8: torch.Tensor, scales: torch.Tensor):
    """Append this call's fp8 index keys to layer ``layer_idx`` of ``cache`` (a transformers cache with
    indexer keys); returns (every cached key [B, T, Di] float8_e4m3fn, their scales [B, T] float32).

    keys8 [B, S, Di] float8_e4m3fn, scales [B, S] float32 (``quantize_fp8_rows``). The layer's own
    ``update_indexer`` stores the bytes (static: in place at its counter; dynamic: concatenated), so its
    crop, reset and offload handle them; the scales follow the same positions. A layer whose keys were
    cached in another dtype (fp8 turned on mid-generation) is an error, as is a scale buffer out of step
    with the keys (a batch move this adapter does not know)."""
    layer = check_index_key_format(cache, layer_idx, fp8=True)
    b, s = scales.shape
    static = hasattr(layer, "indexer_cumulative_length")
    prev = None if static or not getattr(layer, "is_indexer_initialized", False) else layer.indexer_keys.shape[1]
    keys = cache.update_indexer(keys8.view(torch.uint8), layer_idx)
    old = getattr(layer, _SCALE_ATTR, None)
    if static:
        if old is None or old.shape != keys.shape[:2] or old.device != keys.device:
            old = torch.ones(keys.shape[:2], dtype=torch.float32, device=keys.device)
            if not torch.compiler.is_compiling():  # a static address, as the key buffer has (cudagraphs)
                torch._dynamo.mark_static_address(old)
            setattr(layer, _SCALE_ATTR, old)
        # the positions update_indexer wrote: its counter has moved past them
        pos = torch.arange(s, device=keys.device) + (layer.indexer_cumulative_length - s)
        old.index_copy_(1, pos, scales.to(old.device))
        new = old
    else:
        # a dynamic layer's crop slices its keys: the scales past them are dropped here
        kept = old[:, :prev] if old is not None and prev else scales.new_empty(b, 0)
        new = torch.cat([kept.to(scales.device), scales], dim=1)
        setattr(layer, _SCALE_ATTR, new)
    if new.shape != keys.shape[:2]:
        raise RuntimeError(f"the fp8 index keys' scales {tuple(new.shape)} of layer {layer_idx} are out of step "
                           f"with the keys {tuple(keys.shape[:2])} (a batch move of the cache they did not follow)")
    return keys.view(torch.float8_e4m3fn), new


def fused_latent(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> torch.Tensor | None:
    """[B, 1, T, rank + rope] without a copy when ``kv_nope`` and ``k_rot`` are the column halves of
    one buffer (the static cache under :func:`patch_cache_utils`), else None.

    Eager calls check the data pointers; a compiled graph cannot read them and relies on the strides
    (rows ``rank + rope`` apart in both halves), which only such a buffer has: every other producer
    of the two halves (the projections, the dynamic cache's ``torch.cat``) makes contiguous tensors."""
    rank, rope = kv_nope.shape[-1], k_rot.shape[-1]
    if (
        kv_nope.dim() != 4 or kv_nope.dtype != k_rot.dtype or kv_nope.shape[:-1] != k_rot.shape[:-1]
        or kv_nope.stride() != k_rot.stride() or kv_nope.stride(-1) != 1 or kv_nope.stride(-2) != rank + rope
    ):
        return None
    if not torch.compiler.is_compiling() and k_rot.data_ptr() != kv_nope.data_ptr() + rank * kv_nope.element_size():
        return None
    return kv_nope.as_strided((*kv_nope.shape[:-1], rank + rope), kv_nope.stride())
