"""The MLA latent in transformers' static cache: one buffer, so that decoding never copies it.

The DSA models of the V3.2 family cache the compressed latent in two halves, ``keys`` [B, 1, T,
kv_lora_rank] and ``values`` [B, 1, T, rope]. The absorbed sparse MLA reads rows of both at once,
so :func:`~.attention.wrap_expand_kv` joined them with ``torch.cat`` on every step: a copy of the
whole cache per layer and token (B 32 x 128K tokens: 4.8 GB read and written per layer-token).
Here the static cache's two halves become column views of one [B, 1, T, rank + rope] buffer, and
:func:`fused_latent` hands that buffer back as the latent without a copy. The values in the cache
are unchanged (eager and sdpa read the same views), so the patch is inert for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ...patches.attributes import patch_attribute
from .constants import PATCH_KEY

__all__ = ["fused_latent", "patch_cache_utils"]


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


def patch_cache_utils(module) -> None:
    """Patch ``transformers.cache_utils``: the static cache layer of the DSA models (the one with an
    indexer key cache) keeps its MLA latent in one buffer."""
    layer = getattr(module, "StaticIndexedLayer", None)
    if layer is None:  # a transformers without DSA static caches: nothing to do
        return
    patch_attribute(layer, "lazy_initialization", _wrap_lazy_initialization(layer.lazy_initialization),
                    key=f"{PATCH_KEY}.cache")


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
