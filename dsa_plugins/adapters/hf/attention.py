"""The attention function registered as ``dsa_tilelang`` in transformers' ``AttentionInterface``.

:func:`dsa_attention_forward` picks the path for each call:

* latent keys (``value`` of width 0, left by the patched ``expand_kv``) with top-k indices: the
  absorbed sparse MLA of the V3.2 family and glm5_next (:func:`absorbed_mla_forward`: ``W_kc``
  folded into the query, ``sparse_mla`` over the latent, ``W_vc`` on the output);
* an attention class with a registered handler (DeepSeek-V4, see ``models/deepseek_v4.py``);
* anything else (vision and audio towers, dense layers): SDPA, or the model's eager function when
  it has sinks, on the materialised mask.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable

import torch

from ...common.settings import warn_once
from ... import ops
from .cache import fused_latent
from .constants import ATTN_NAME
from .indexer_loss import pending_loss
from .masks import DenseMask, LazyMask, TopkSelection, as_mask, mask_indices

__all__ = [
    "absorbed_mla_forward",
    "clear_handlers",
    "dsa_attention_forward",
    "register_handler",
    "wrap_expand_kv",
]


# attention class -> handler(module, query, key, value, mask, scaling, **kwargs), for models whose
# attention is not absorbed MLA over indices (DeepSeek-V4); filled by the model patches.
_HANDLERS: dict[type, Callable] = {}
_lock = threading.RLock()


def register_handler(attention_cls: type, handler: Callable) -> None:
    """Route ``attention_cls`` (and its subclasses) to ``handler`` under dsa_tilelang."""
    with _lock:
        _HANDLERS[attention_cls] = handler


def clear_handlers() -> None:
    """Forget every handler (``unregister``)."""
    with _lock:
        _HANDLERS.clear()


def _handler_for(module) -> Callable | None:
    for cls in type(module).__mro__:
        handler = _HANDLERS.get(cls)
        if handler is not None:
            return handler
    return None


def dsa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    indices: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry for "dsa_tilelang".

    query [B, H, S, D]; returns ``(out [B, S, H, Dv], None)`` like transformers' attention functions.
    * latent keys (``value`` of width 0, set by the patched ``expand_kv``) with ``indices`` (or a
      :class:`TopkSelection` in place of the mask, glm5_next): absorbed sparse MLA;
    * a model with a registered handler (DeepSeek-V4): that handler;
    * anything else (vision / audio towers, dense layers): SDPA, or the model's eager function when it
      has sinks, on the materialised mask.
    """
    if kwargs.get("output_attentions"):
        # transformers would hand back an empty tuple: say so instead (as its config does for sdpa)
        raise ValueError(
            "dsa_tilelang: output_attentions=True is not supported: the sparse path never forms the "
            "attention probabilities. Switch to eager for that call (model.set_attn_implementation('eager'))."
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout and module.training:
        warn_once("hf:dropout", "dsa_tilelang: attention dropout is not supported by the sparse path; ignored")
    if value.shape[-1] == 0:
        if indices is None and isinstance(attention_mask, TopkSelection):
            indices = attention_mask.indices
        if indices is None:
            raise RuntimeError(
                f"dsa_tilelang: {type(module).__name__} kept its MLA latent but received no top-k indices"
            )
        return absorbed_mla_forward(module, query, key, attention_mask, scaling, indices, kwargs.get("s_aux"))
    handler = _handler_for(module)
    if handler is not None:
        return handler(module, query, key, value, attention_mask, scaling, **kwargs)
    return _dense_fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _dense_fallback(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    mask = attention_mask.dense() if isinstance(attention_mask, LazyMask) else attention_mask
    kwargs.pop("indices", None)
    if kwargs.get("s_aux") is not None:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"dsa_tilelang: no dense fallback with sinks for {type(module).__name__}")
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, torch.finfo(query.dtype).min
            )
        return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("sliding_window", None)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def absorbed_mla_forward(module, query, latent, attention_mask, scaling, indices, sink=None):
    """Absorbed MLA over the kept latent. query [B,H,S,nope+rope], latent [B,1,T,rank+rope]."""
    B, H, S, Dqk = query.shape
    nope, rank, vdim = module.qk_nope_head_dim, module.kv_lora_rank, module.v_head_dim
    kv = latent[:, 0]
    T = kv.shape[1]
    if kv.shape[-1] - rank != Dqk - nope:
        raise RuntimeError(
            f"dsa_tilelang: {type(module).__name__}: latent width {kv.shape[-1]} - kv_lora_rank {rank} does not "
            f"match the query's rope width {Dqk - nope}"
        )
    proj = module.kv_b_proj
    if getattr(proj, "bias", None) is not None:
        raise RuntimeError(f"dsa_tilelang: {type(module).__name__}.kv_b_proj has a bias; it cannot be absorbed")
    w = proj.weight.view(H, nope + vdim, rank)
    w_kc, w_vc = w[:, :nope].to(query.dtype), w[:, nope:].to(query.dtype)
    q_nope, q_rope = query.split([nope, Dqk - nope], dim=-1)
    q_abs = torch.cat([torch.einsum("bhsn,hnc->bshc", q_nope, w_kc), q_rope.transpose(1, 2)], dim=-1)
    if isinstance(attention_mask, TopkSelection):
        idx = attention_mask.indices  # glm5_next: the selection is the mask (already checked, unique)
    elif isinstance(attention_mask, LazyMask) and not isinstance(attention_mask, DenseMask):
        idx = indices.to(torch.int32)  # from the patched indexer: already -1 wherever the mask forbids
    else:
        idx = mask_indices(indices, as_mask(attention_mask, B, S, T, query.device))
    out = ops.sparse_mla(q_abs, kv, idx, w_vc, scaling, sink=None if sink is None else sink.float(),
                         indexer_loss=pending_loss(module))  # enable_indexer_loss: fused into the backward
    return out, None


def _layer_gets_indices(attn) -> bool:
    return getattr(attn, "indexer", None) is not None or bool(getattr(attn, "skip_topk", False))


def wrap_expand_kv(original: Callable) -> Callable:
    """``*Attention.expand_kv`` under dsa_tilelang, on layers that receive top-k indices: return the
    MLA latent ``[B, 1, T, rank + rope]`` as the key and an empty value, instead of per-head K/V
    (the other half of :func:`absorbed_mla_forward`)."""

    @functools.wraps(original)
    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        if self.config._attn_implementation != ATTN_NAME or not _layer_gets_indices(self):
            return original(self, kv_nope, k_rot)
        latent = fused_latent(kv_nope, k_rot)  # the static cache's one buffer: no copy
        if latent is None:
            latent = torch.cat([kv_nope, k_rot.to(kv_nope.dtype)], dim=-1)  # [B, 1, T, rank + rope]
        return latent, latent.new_empty(*latent.shape[:-1], 0)

    return expand_kv
