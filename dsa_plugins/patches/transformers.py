"""Patches that route Hugging Face Transformers' DSA models through dsa_plugins' sparse ops.

Three layers of patching, each idempotent and reversible (see :mod:`dsa_plugins.patches._core`):

1. ``"dsa_tilelang"`` in ``AttentionInterface`` (the attention function,
   :func:`dsa_attention_forward`) and in ``AttentionMaskInterface`` (:func:`dsa_mask`, which returns
   a :class:`LazyMask`: the description of the mask instead of its ``[B, 1, S, T]`` tensor).
2. Per-model patches, applied to a modeling module once it has finished importing:

   * V3.2 family (deepseek_v32, glm_moe_dsa, axk2, hy_v4, mistral_large4 text, dots3_note text):
     ``*Attention.expand_kv`` keeps the MLA latent instead of expanding per-head K/V (the attention
     function absorbs ``W_kc`` into the query and applies ``W_vc`` to the output: ``sparse_mla``);
     ``*Indexer.forward`` scores through ``indexer_topk`` (no ``[B, S, T]`` score matrix).
   * deepseek_v4: the CSA indexer keeps the model's own compression code but scores through
     ``indexer_topk`` (its dense scorer is never called); its top-k and the compressors' positions
     are kept on the modules for the call, and the attention function gathers the sliding-window
     rows plus the selected (CSA) or causally visible (HCA) compressed rows (``sparse_attention``
     with the per-head sink). Known cost left: the CSA/HCA compressors still build their
     ``block_bias`` ([B, 1, S, T/ratio]), which the sparse path ignores.
   * glm5_next (GLM-5.3, NoPE MLA with a k-pool indexer): ``expand_kv`` keeps the latent as above;
     the indexer scores the compressed pools through ``indexer_topk`` (:func:`glm5_next_select`,
     no ``[B, S, T]`` visibility or score tensors) and ``build_attention_mask_from_topk`` returns a
     :class:`TopkSelection` (the unique key columns) instead of the ``[B, 1, S, T]`` mask.

3. Everything is active only while ``config._attn_implementation == "dsa_tilelang"``: the wrapped
   methods call the originals otherwise, so eager / sdpa models in the same process are untouched.

Indices that the mask forbids (future keys, padding, outside the sliding window) become ``-1``.
Query rows with no valid key give zeros (or the sink-weighted zero), never NaN.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ._core import (
    PatchPointMissing,
    UnsupportedVersion,
    patch_attribute,
    require_version,
    revert_patches,
)

logger = logging.getLogger("dsa_plugins")

ATTN_NAME = "dsa_tilelang"
KEY = "hf"  # patch keys: "hf.interfaces", "hf.<model_type>"
MIN_VERSION = "5.17.0"
BELOW_VERSION = "6.0.0"

_lock = threading.RLock()
_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def _ops():
    from dsa_plugins import ops

    return ops


# --------------------------------------------------------------------------------------------
# The mask: a description, materialised only when a dense fallback needs it
# --------------------------------------------------------------------------------------------


def _is_head_slice(key) -> bool:
    """``[:, 0]`` or ``[:, 0, :, :]``: the models drop the (size-1) head axis before the indexer."""
    if not isinstance(key, tuple) or len(key) not in (2, 4):
        return False
    first, head, *rest = key
    full = lambda k: isinstance(k, slice) and k.start is None and k.stop is None and k.step is None
    return full(first) and type(head) is int and head == 0 and all(full(k) for k in rest)


def _is_plain_sliding(fn, causal) -> bool:
    """``and_masks(sliding_window_overlay(W), causal_mask_function)`` and nothing else (no packing,
    no extra and/or functions): recognised from the closure of transformers' ``and_masks``."""
    if not getattr(fn, "__qualname__", "").startswith("and_masks."):
        return False
    for cell in fn.__closure__ or ():
        try:
            parts = cell.cell_contents
        except ValueError:
            continue
        if isinstance(parts, tuple) and len(parts) == 2:
            first, second = parts
            return second is causal and getattr(first, "__qualname__", "").startswith("sliding_window_overlay.")
    return False


class LazyMask:
    """What ``AttentionMaskInterface["dsa_tilelang"]`` returns.

    Holds the arguments transformers passes to a mask function (sizes, offsets, the 2D padding
    mask, the mask function, the sliding window) and answers the two questions the sparse path
    asks, without an ``O(S*T)`` tensor for the causal and sliding-window masks:

    * :meth:`windows`: per query row, the contiguous range ``[start, end)`` of key columns it may see;
    * :meth:`allowed`: whether given key columns are allowed (holes in the padding mask included).

    ``mask[:, 0]`` / ``mask[:, 0, :, :]`` return the mask itself (the models slice the head axis
    before calling their indexer); any other indexing, or :meth:`dense`, materialises the boolean
    ``[B, 1, S, T]`` mask through ``transformers.masking_utils.sdpa_mask``.
    """

    ndim = 4
    dtype = torch.bool

    def __init__(
        self,
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int | torch.Tensor = 0,
        kv_offset: int = 0,
        mask_function: Callable | None = None,
        attention_mask: torch.Tensor | None = None,
        local_size: int | None = None,
        use_vmap: bool = False,
        device: torch.device | str = "cpu",
        **_ignored: Any,
    ):
        self.batch_size = int(batch_size)
        self.q_length = int(q_length)
        self.kv_length = int(kv_length)
        self.q_offset = q_offset
        self.kv_offset = int(kv_offset)
        self.mask_function = mask_function
        self.padding = attention_mask
        self.local_size = local_size
        self.use_vmap = use_vmap
        self.device = torch.device(device)
        self._dense: torch.Tensor | None = None
        self._windows: tuple[torch.Tensor, torch.Tensor] | None = None

    # tensor-like surface used by model code
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.batch_size, 1, self.q_length, self.kv_length))

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __getitem__(self, key):
        if _is_head_slice(key):
            return self
        return self.dense()[key]

    def __repr__(self) -> str:
        kind = "fast" if self.is_simple else "dense"
        return (
            f"LazyMask(B={self.batch_size}, S={self.q_length}, T={self.kv_length}, q_offset={self.q_offset}, "
            f"kv_offset={self.kv_offset}, window={self.local_size}, padding={self.padding is not None}, {kind})"
        )

    @property
    def is_simple(self) -> bool:
        """True for the causal and the causal sliding-window masks (plus padding): computed in O(S)."""
        if self.use_vmap or self.mask_function is None:
            return self.mask_function is None
        from transformers.masking_utils import causal_mask_function

        if self.mask_function is causal_mask_function:
            return self.local_size is None
        # create_sliding_window_causal_mask passes and_masks(sliding overlay, causal) and local_size=W
        return self.local_size is not None and _is_plain_sliding(self.mask_function, causal_mask_function)

    def query_positions(self) -> torch.Tensor:
        """Absolute position of every query row, [S] int64."""
        offset = self.q_offset
        if isinstance(offset, torch.Tensor):
            offset = offset.to(self.device, torch.long)
        return torch.arange(self.q_length, device=self.device, dtype=torch.long) + offset

    def local_padding(self) -> torch.Tensor | None:
        """The 2D padding mask over this mask's key columns, [B, T] bool (None: no padding)."""
        if self.padding is None:
            return None
        pad = self.padding.to(self.device).bool()
        need = self.kv_offset + self.kv_length
        if pad.shape[-1] < need:  # keys past the 2D mask are masked, as transformers does
            pad = torch.nn.functional.pad(pad, (0, need - pad.shape[-1]), value=False)
        return pad[:, self.kv_offset : need]

    def dense(self) -> torch.Tensor:
        """The boolean [B, 1, S, T] mask (True = may attend)."""
        if self._dense is None:
            from transformers.masking_utils import causal_mask_function, sdpa_mask

            mask = sdpa_mask(
                batch_size=self.batch_size,
                q_length=self.q_length,
                kv_length=self.kv_length,
                q_offset=self.q_offset,
                kv_offset=self.kv_offset,
                mask_function=self.mask_function or causal_mask_function,
                attention_mask=self.padding,
                allow_is_causal_skip=False,
                use_vmap=self.use_vmap,
                device=self.device,
            )
            self._dense = mask.expand(self.batch_size, 1, self.q_length, self.kv_length)
        return self._dense

    def windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row, key columns ``[start, end)`` it may see: two [B, S] int64 tensors."""
        if self._windows is not None:
            return self._windows
        B, S, T = self.batch_size, self.q_length, self.kv_length
        if self.is_simple:
            pos = self.query_positions()
            end = (pos + 1 - self.kv_offset).clamp(0, T)
            if self.local_size is not None:
                start = (pos - int(self.local_size) + 1 - self.kv_offset).clamp(0, T)
            else:
                start = torch.zeros_like(end)
            start, end = start.expand(B, S), end.expand(B, S)
            pad = self.local_padding()
            if pad is not None:
                has = pad.any(-1)
                first = torch.where(has, pad.to(torch.int8).argmax(-1), torch.full_like(has, T, dtype=torch.long))
                start = torch.maximum(start, first[:, None])
            end = torch.maximum(end, start)
        else:
            d = self.dense()[:, 0]
            has = d.any(-1)
            start = torch.where(has, d.to(torch.int8).argmax(-1), 0)
            end = torch.where(has, T - d.flip(-1).to(torch.int8).argmax(-1), 0)
        self._windows = (start.contiguous(), end.contiguous())
        return self._windows

    def has_holes(self) -> bool:
        """True when some row's allowed keys are not one contiguous range (padding with gaps)."""
        if not self.is_simple:
            return True
        pad = self.local_padding()
        if pad is None:
            return False
        after_first = pad.to(torch.int8).cummax(-1).values.bool()
        return bool((after_first & ~pad).any())

    def allowed(self, idx: torch.Tensor) -> torch.Tensor:
        """Whether key columns ``idx`` [B, S, k] are allowed for their query rows (bool [B, S, k])."""
        T = self.kv_length
        idx = idx.long()
        in_range = (idx >= 0) & (idx < T)
        safe = idx.clamp(0, max(T - 1, 0))
        if T == 0:
            return torch.zeros_like(in_range)
        if self.is_simple:
            start, end = self.windows()
            ok = in_range & (idx >= start[..., None]) & (idx < end[..., None])
            pad = self.local_padding()
            if pad is not None:
                B = idx.shape[0]
                ok &= pad.gather(1, safe.reshape(B, -1)).view_as(idx)
            return ok
        return in_range & self.dense()[:, 0].gather(-1, safe)


class DenseMask(LazyMask):
    """A user-supplied 4D tensor mask (bool, or additive float) behind the LazyMask interface."""

    def __init__(self, mask: torch.Tensor, q_offset: int | None = None):
        B, _, S, T = mask.shape
        super().__init__(B, S, T, q_offset=(T - S) if q_offset is None else q_offset, device=mask.device)
        if mask.dtype != torch.bool:
            mask = mask > torch.finfo(mask.dtype).min / 2
        self._dense = mask[:, :1].expand(B, 1, S, T)

    @property
    def is_simple(self) -> bool:
        return False


def as_mask(mask, batch_size: int, q_length: int, kv_length: int, device) -> LazyMask:
    """LazyMask view of whatever the model passed: a LazyMask, a 4D/3D tensor, or None (causal)."""
    if isinstance(mask, LazyMask):
        return mask
    if mask is None:
        return LazyMask(batch_size, q_length, kv_length, q_offset=kv_length - q_length, device=device)
    if isinstance(mask, torch.Tensor):
        if mask.ndim == 3:
            mask = mask[:, None]
        if mask.ndim == 4:
            return DenseMask(mask.expand(batch_size, mask.shape[1], q_length, mask.shape[-1]))
    raise TypeError(f"dsa_tilelang: unsupported attention mask of type {type(mask).__name__}")


def dsa_mask(batch_size: int, q_length: int, kv_length: int, **kwargs) -> LazyMask:
    """``AttentionMaskInterface`` entry for "dsa_tilelang": a :class:`LazyMask` (no O(S*T) tensor)."""
    kwargs.pop("allow_is_causal_skip", None)
    kwargs.pop("allow_is_bidirectional_skip", None)
    kwargs.pop("dtype", None)
    kwargs.pop("config", None)
    return LazyMask(batch_size, q_length, kv_length, **kwargs)


def mask_indices(indices: torch.Tensor, mask: LazyMask) -> torch.Tensor:
    """Map indices the mask forbids to -1 (int32 out)."""
    idx = indices.long()
    return torch.where(mask.allowed(idx), idx, torch.full_like(idx, -1)).to(torch.int32)


# --------------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------------

# attention class -> handler(module, query, key, value, mask, scaling, **kwargs) for model-specific paths
_HANDLERS: dict[type, Callable] = {}


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
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout and module.training:
        _warn_once("dropout", "dsa_tilelang: attention dropout is not supported by the sparse path; ignored")
    if value.shape[-1] == 0:
        if indices is None and isinstance(attention_mask, TopkSelection):
            indices = attention_mask.indices
        if indices is None:
            raise RuntimeError(
                f"dsa_tilelang: {type(module).__name__} kept its MLA latent but received no top-k indices"
            )
        return _sparse_mla_forward(module, query, key, attention_mask, scaling, indices, kwargs.get("s_aux"))
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


def _sparse_mla_forward(module, query, latent, attention_mask, scaling, indices, sink=None):
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
    out = _ops().sparse_mla(q_abs, kv, idx, w_vc, scaling, sink=None if sink is None else sink.float())
    return out, None


# --------------------------------------------------------------------------------------------
# V3.2 family: expand_kv keeps the latent; the indexer goes through indexer_topk
# --------------------------------------------------------------------------------------------


def _layer_gets_indices(attn) -> bool:
    return getattr(attn, "indexer", None) is not None or bool(getattr(attn, "skip_topk", False))


def _wrap_expand_kv(original: Callable) -> Callable:
    @functools.wraps(original)
    def expand_kv(self, kv_nope: torch.Tensor, k_rot: torch.Tensor):
        if self.config._attn_implementation != ATTN_NAME or not _layer_gets_indices(self):
            return original(self, kv_nope, k_rot)
        latent = torch.cat([kv_nope, k_rot.to(kv_nope.dtype)], dim=-1)  # [B, 1, T, rank + rope]
        return latent, latent.new_empty(*latent.shape[:-1], 0)

    return expand_kv


def select_topk(
    indexer, q: torch.Tensor, k_new: torch.Tensor, weights: torch.Tensor, mask: LazyMask, past_key_values
) -> torch.Tensor:
    """Shared tail of every V3.2-family indexer: cache, windows, ``indexer_topk``, mask -> -1.

    q [B, S, Hi, Di] (rope applied), k_new [B, S, Di], weights [B, S, Hi] fp32 with every scale
    folded in. Returns [B, S, min(index_topk, T)] int32 key columns, -1 where none / forbidden.
    """
    k = past_key_values.update_indexer(k_new, indexer.layer_idx) if past_key_values is not None else k_new
    B, S, Hi, Di = q.shape
    T = k.shape[1]
    mask = as_mask(mask, B, S, T, q.device)
    start, end = mask.windows()
    end = end.clamp(max=T)
    start = torch.minimum(start, end)
    base = (torch.arange(B, device=q.device, dtype=torch.int32) * T)[:, None]
    topk = min(int(indexer.index_topk), T)
    rows = _ops().indexer_topk(
        q.reshape(B * S, Hi, Di),
        k.reshape(B * T, Di).to(q.dtype),
        weights.reshape(B * S, Hi).float(),
        topk,
        (start.to(torch.int32) + base).reshape(-1),
        (end.to(torch.int32) + base).reshape(-1),
    )
    local = rows.view(B, S, -1).to(torch.int32)  # global rows of index_k -> key columns of each batch row
    if B > 1:
        local = torch.where(local >= 0, local - base[..., None], local)
    # indexer_topk only returns keys inside each row's window; the mask is needed for holes only
    return mask_indices(local, mask) if mask.has_holes() else local


def _rope_fn(indexer, name: str) -> Callable:
    fn = getattr(sys.modules[type(indexer).__module__], name, None)
    if fn is None:
        raise PatchPointMissing(f"dsa_tilelang: {type(indexer).__module__}.{name} is missing")
    return fn


def _project_rope_first(rope_name: str, rope_first: bool = True, fold_scale: bool = True):
    """Indexer projections of the DeepSeek-V3.2 kind (q from ``q_resid``), parametrised by the rope
    function, where the rope slice sits (first or last dims), and the k_norm dtype handling."""

    def project(indexer, hidden_states, q_resid, position_embeddings, position_ids):
        B, S, _ = hidden_states.shape
        Hi, Di, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
        cos, sin = position_embeddings
        q = indexer.wq_b(q_resid).view(B, S, Hi, Di)
        k_in = indexer.wk(hidden_states)
        if rope_first:
            k = indexer.k_norm(k_in).unsqueeze(2)
        else:  # hy_v4 keeps its k_norm in fp32
            k = indexer.k_norm(k_in.to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype).unsqueeze(2)
        split = [R, Di - R] if rope_first else [Di - R, R]
        q_a, q_b = torch.split(q, split, dim=-1)
        k_a, k_b = torch.split(k, split, dim=-1)
        rope = _rope_fn(indexer, rope_name)
        if rope_first:
            q_a, k_a = rope(q_a, k_a, cos, sin, unsqueeze_dim=2)
        else:
            q_b, k_b = rope(q_b, k_b, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_a, q_b], dim=-1)
        k = torch.cat([k_a, k_b], dim=-1).squeeze(2)
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (Hi**-0.5) * indexer.softmax_scale  # relu(c*x) = c*relu(x) for c > 0
        return q, k, w

    return project


def _project_mistral_large4(indexer, hidden_states, q_resid, position_embeddings, position_ids):
    B, S, _ = hidden_states.shape
    Hi, Di, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(indexer.q_input_norm(hidden_states)).view(B, S, Hi, Di)
    q = indexer.softmax_scaling(q, position_ids, head_dim_first=False)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    if indexer.use_rope:
        cos, sin = position_embeddings
        q_rot, q_pass = torch.split(q, [R, Di - R], dim=-1)
        k_rot, k_pass = torch.split(k, [R, Di - R], dim=-1)
        q_rot, k_rot = _rope_fn(indexer, "apply_rotary_pos_emb_interleave")(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1)
    k = k.squeeze(2)
    w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, w * (Hi**-0.5) * indexer.softmax_scale


def _wrap_indexer_forward(original: Callable, project: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        mask = a.get("attention_mask")
        if not isinstance(mask, LazyMask):  # not our implementation (or a user-built 4D mask)
            return original(self, *args, **kwargs)
        with torch.no_grad():
            q, k, w = project(
                self, a["hidden_states"], a.get("q_resid"), a["position_embeddings"], a.get("position_ids")
            )
            return select_topk(self, q, k, w, mask, a.get("past_key_values"))

    return forward


# --------------------------------------------------------------------------------------------
# DeepSeek-V4: sliding-window rows + compressed rows, with sinks
# --------------------------------------------------------------------------------------------


def _wrap_capture(original: Callable, attr: str, what: str) -> Callable:
    """Wrap a forward to keep ``what`` ("result" or "position_ids") on the module as ``attr``."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if what == "result":
            setattr(self, attr, out)
        else:
            setattr(self, attr, sig.bind(self, *args, **kwargs).arguments.get(what))
        return out

    return forward


class _ScoresCaptured(Exception):
    """Raised by :class:`_CaptureScorer` to stop DeepseekV4Indexer.forward before it scores densely."""

    def __init__(self, q, keys):
        super().__init__("captured")
        self.q, self.keys = q, keys


class _CaptureScorer(torch.nn.Module):
    """Stands in for ``DeepseekV4Indexer.scorer`` for one call: receives the rope'd queries and the
    compressed keys (the model's own code computed them and updated its cache) and stops there."""

    def forward(self, q, compressed_kv, hidden_states):
        raise _ScoresCaptured(q, compressed_kv)


def _wrap_v4_indexer(original: Callable) -> Callable:
    """DeepSeek-V4 CSA indexer through ``indexer_topk``: the model's code builds the compressed keys
    and queries; the O(S * T/4 * heads) score tensor and its top-k are replaced by the fused op.
    The result (top-k compressed rows, -1 where not yet visible) is kept on the module for the
    attention function, as in eager mode it is turned into a block bias by the CSA compressor."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if getattr(self, "_dsa_active", False) is not True:
            out = original(self, *args, **kwargs)
            self._dsa_topk = out
            return out
        a = sig.bind(self, *args, **kwargs).arguments
        scorer = self._modules["scorer"]
        self._modules["scorer"] = _CaptureScorer()
        try:
            original(self, *args, **kwargs)
        except _ScoresCaptured as captured:
            q, keys = captured.q, captured.keys
        else:
            raise PatchPointMissing("dsa_plugins: DeepseekV4Indexer.forward no longer calls self.scorer")
        finally:
            self._modules["scorer"] = scorer
        hidden_states, position_ids = a["hidden_states"], a["position_ids"]
        B, S, Hi, Di = q.shape
        T = keys.shape[1]
        if T == 0:
            out = torch.full((B, S, 0), -1, dtype=torch.int32, device=q.device)
            self._dsa_topk = out
            return out
        with torch.no_grad():
            w = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling * scorer.softmax_scale
            visible = ((position_ids.to(q.device) + 1) // self.compress_rate).clamp(0, T).expand(B, S)
            base = (torch.arange(B, device=q.device, dtype=torch.int32) * T)[:, None]
            rows = _ops().indexer_topk(
                q.reshape(B * S, Hi, Di),
                keys.reshape(B * T, Di).to(q.dtype),
                w.reshape(B * S, Hi),
                min(int(self.index_topk), T),
                base.expand(B, S).reshape(-1),
                (visible.to(torch.int32) + base).reshape(-1),
            )
            out = rows.view(B, S, -1).to(torch.int32)
            if B > 1:
                out = torch.where(out >= 0, out - base[..., None], out)
        self._dsa_topk = out
        return out

    return forward


def _wrap_v4_attention_forward(original: Callable) -> Callable:
    """Tell the layer's CSA indexer (if any) whether this call runs under dsa_tilelang."""

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        indexer = getattr(getattr(self, "compressor", None), "indexer", None)
        if indexer is None:
            return original(self, *args, **kwargs)
        indexer._dsa_active = self.config._attn_implementation == ATTN_NAME
        try:
            return original(self, *args, **kwargs)
        finally:
            indexer._dsa_active = False

    return forward


def _v4_attention(module, query, key, value, attention_mask, scaling, s_aux=None, sliding_window=None, **kwargs):
    """DeepSeek-V4: query [B,H,S,D]; key = value = [B,1,Tw+Tc,D] (sliding rows, then compressed rows)."""
    B, _, S, _ = query.shape
    kv = key[:, 0]
    mask = attention_mask
    if not isinstance(mask, LazyMask):
        raise RuntimeError(
            "dsa_tilelang: DeepSeek-V4 needs the sliding-window mask built by transformers' mask interface "
            f"(got {type(mask).__name__}); do not pass a prebuilt 4D mask"
        )
    Tw = mask.kv_length
    Tc = kv.shape[1] - Tw
    W = int(sliding_window or mask.local_size or Tw)
    pos = mask.query_positions()
    cand = (pos - mask.kv_offset)[:, None] - torch.arange(W - 1, -1, -1, device=query.device)
    cand = cand.expand(B, S, W)
    parts = [torch.where(mask.allowed(cand), cand, torch.full_like(cand, -1)).to(torch.int32)]
    comp = getattr(module, "compressor", None)
    if comp is not None and Tc > 0:
        indexer = getattr(comp, "indexer", None)
        if indexer is not None:  # CSA: the indexer's top-k compressed rows (-1 = not yet visible)
            topk = getattr(indexer, "_dsa_topk", None)
            if topk is None or topk.shape[:2] != (B, S):
                raise RuntimeError("dsa_tilelang: DeepSeek-V4 CSA top-k was not captured for this call")
            topk = topk.to(torch.int32)
            parts.append(torch.where(topk >= 0, topk + Tw, topk))
        else:  # HCA: every compressed row whose window has closed before the query
            rows = torch.arange(Tc, device=query.device, dtype=torch.int32)
            if S == 1:
                valid = torch.ones(B, S, Tc, dtype=torch.bool, device=query.device)
            else:
                position_ids = getattr(comp, "_dsa_position_ids", None)
                if position_ids is None:
                    raise RuntimeError("dsa_tilelang: DeepSeek-V4 HCA positions were not captured for this call")
                threshold = (position_ids.to(query.device) + 1) // comp.compress_rate
                valid = (rows.view(1, 1, -1) < threshold[..., None]).expand(B, S, Tc)
            parts.append(torch.where(valid, rows + Tw, torch.full_like(rows, -1)))
    idx = torch.cat(parts, dim=-1).to(torch.int32)
    sink = s_aux.float() if s_aux is not None else None
    out = _ops().sparse_attention(query.transpose(1, 2), kv, idx, scaling, sink=sink)
    return out, None


# --------------------------------------------------------------------------------------------
# GLM-5.3 (glm5_next): k-pool indexer whose top-k is the attention mask
# --------------------------------------------------------------------------------------------


class TopkSelection:
    """What ``Glm5NextTextAttention.build_attention_mask_from_topk`` returns under dsa_tilelang.

    glm5_next turns its indexer's top-k into the only mask the attention sees (the indexer already
    applied causality and padding). Instead of that ``[B, 1, S, T]`` mask the attention function
    receives ``indices`` [B, S, k] int32: key columns in ``[0, T)``, each at most once per row
    (the dense mask is a set), -1 elsewhere.
    """

    def __init__(self, indices: torch.Tensor):
        self.indices = indices

    @property
    def shape(self) -> torch.Size:
        return self.indices.shape

    def __repr__(self) -> str:
        return f"TopkSelection(shape={tuple(self.indices.shape)})"


def unique_key_columns(indices: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Indices as a set per row: out-of-range and repeated columns become -1 (int32, sorted rows)."""
    idx = indices.to(torch.int32)
    idx = idx.masked_fill((idx < 0) | (idx >= kv_length), -1).sort(dim=-1).values
    repeated = torch.zeros_like(idx, dtype=torch.bool)
    repeated[..., 1:] = (idx[..., 1:] == idx[..., :-1]) & (idx[..., 1:] >= 0)
    return idx.masked_fill(repeated, -1)


def _wrap_topk_mask(original: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def build_attention_mask_from_topk(self, *args, **kwargs):
        if self.config._attn_implementation != ATTN_NAME:
            return original(self, *args, **kwargs)
        a = sig.bind(self, *args, **kwargs).arguments
        return TopkSelection(unique_key_columns(a["topk_indices"], int(a["kv_length"])))

    return build_attention_mask_from_topk


def glm5_next_select(indexer, hidden_states, q_resid, attention_mask, past_key_values) -> torch.Tensor:
    """The glm5_next indexer's selection without its ``[B, S, T]`` tensors.

    Same inputs, cache update and result (as a set per row) as ``Glm5NextTextIndexer.forward``:
    the model's own ``get_pooled_states`` builds the compressed pool keys (O(T)); the pools a
    query may pick (complete, all keys valid, last key at or before the query) are, once the
    valid pools are moved to the front, a prefix ``[0, n)`` of them, so ``indexer_topk`` scores
    them in per-row windows; the selected pools are expanded back to key columns and the
    incomplete tail pool (when ``index_kpool_always_select_tail``) is appended from a cumulative
    count of the valid keys. Returns [B, S, index_topk (+ index_kpool - 1)] int32, -1 = no key.
    """
    B, S = hidden_states.shape[:2]
    Hi, Di, P = indexer.n_heads, indexer.head_dim, indexer.index_kpool
    device = hidden_states.device
    q = indexer.wq_b(q_resid).view(B, S, Hi, Di)
    k = indexer.k_norm(indexer.wk(hidden_states)).view(B, S, Di)
    gate = torch.nn.functional.linear(hidden_states, indexer.index_kpool_compress_gate)
    packed = torch.cat([k, gate, attention_mask.to(k.dtype)[..., None]], dim=-1)
    current = S
    if past_key_values is not None:
        packed = past_key_values.update_indexer(packed, indexer.layer_idx)
        current = past_key_values.layers[indexer.layer_idx].get_seq_length()
    T = packed.shape[1]
    valid_keys = packed[..., -1].bool()  # [B, T]
    q_pos = (torch.arange(S, device=device) + (current - S)).expand(B, S).contiguous()  # cache slot of each query

    pool_keys, pool_indices, pool_valid = indexer.get_pooled_states(packed_states=packed)
    n_pools = pool_keys.shape[1]
    select_k = min(int(indexer.index_topk) // P, n_pools)
    if select_k > 0:
        # valid pools first (stable: still in order of their last key), invalid ones pushed past every query
        last = torch.where(pool_valid, pool_indices[..., -1], torch.full_like(pool_indices[..., -1], T))
        last, order = last.sort(dim=-1, stable=True)
        count = torch.searchsorted(last, q_pos, right=True)  # [B, S] pools closed at or before the query
        keys = pool_keys.gather(1, order[..., None].expand(B, n_pools, Di))
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (Hi**-0.5) * indexer.softmax_scale  # relu(c*x) = c*relu(x) for c > 0
        base = (torch.arange(B, device=device, dtype=torch.long) * n_pools)[:, None]
        rows = _ops().indexer_topk(
            q.reshape(B * S, Hi, Di),
            keys.reshape(B * n_pools, Di).to(q.dtype),
            w.reshape(B * S, Hi),
            select_k,
            base.expand(B, S).reshape(-1).to(torch.int32),
            (count + base).reshape(-1).to(torch.int32),
        ).view(B, S, select_k)
        picked = rows >= 0
        pool = order.gather(1, torch.where(picked, rows.long() - base[..., None], 0).view(B, -1))
        # a valid pool holds P consecutive key columns starting at its first one
        first_col = pool_indices[..., 0].to(torch.int32).gather(1, pool).view(B, S, select_k, 1)
        cols = first_col + torch.arange(P, device=device, dtype=torch.int32)
        cols = cols.masked_fill(~picked[..., None], -1).flatten(-2)
    else:
        cols = torch.full((B, S, 0), -1, dtype=torch.int32, device=device)

    width = int(indexer.index_topk)
    parts = [cols]
    if indexer.index_kpool_always_select_tail and P > 1:
        width += P - 1
        first = torch.where(valid_keys.any(-1), valid_keys.long().argmax(-1), torch.full((B,), T, device=device))
        visible = valid_keys.long().cumsum(-1).gather(1, q_pos.clamp(max=T - 1))  # [B, S] keys visible to the query
        in_tail = visible.remainder(P)
        offsets = torch.arange(P - 1, device=device)
        tail = (first[:, None] + visible - in_tail)[..., None] + offsets  # [B, S, P - 1]
        safe = tail.clamp(0, T - 1)
        ok = (offsets < in_tail[..., None]) & (tail < T) & (tail <= q_pos[..., None])
        ok &= valid_keys.gather(1, safe.view(B, -1)).view_as(tail)
        parts.append(tail.to(torch.int32).masked_fill(~ok, -1))
    out = torch.cat(parts, dim=-1)
    out = torch.nn.functional.pad(out, (0, max(width - out.shape[-1], 0)), value=-1)[..., :width]
    return out.masked_fill(~attention_mask.bool()[..., None], -1)


def _wrap_glm5_next_indexer(original: Callable) -> Callable:
    sig = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        mask = a.get("attention_mask")
        if (
            self.config._attn_implementation != ATTN_NAME
            or not isinstance(mask, torch.Tensor)
            or mask.dim() != 2
        ):
            return original(self, *args, **kwargs)
        if not self.index_kpool_always_select_tail and self.index_kpool > 1:
            _warn_once(
                "glm5_next_tail",
                "dsa_tilelang: glm5_next with index_kpool_always_select_tail=False: the first index_kpool - 1 "
                "tokens of a sequence select no key; the sparse path gives them zeros, eager averages every "
                "key of the batch row (future and padding included), so the outputs differ from eager",
            )
        with torch.no_grad():
            return glm5_next_select(self, a["hidden_states"], a["q_resid"], mask, a.get("past_key_values"))

    return forward


# --------------------------------------------------------------------------------------------
# Per-model patch functions (called with the modeling module once it has finished importing)
# --------------------------------------------------------------------------------------------


def _cls(module, name: str):
    cls = getattr(module, name, None)
    if cls is None:
        raise PatchPointMissing(
            f"dsa_plugins: expected class {name} in {module.__name__}; this transformers version moved it"
        )
    return cls


def _patch_v32_family(module, model_type: str, attention: str, indexer: str, project: Callable) -> None:
    key = f"{KEY}.{model_type}"
    attn_cls, idx_cls = _cls(module, attention), _cls(module, indexer)
    for cls, name in ((attn_cls, "expand_kv"), (idx_cls, "forward")):
        if name not in cls.__dict__:
            raise PatchPointMissing(f"dsa_plugins: expected {cls.__qualname__}.{name} in {module.__name__}")
    patch_attribute(attn_cls, "expand_kv", _wrap_expand_kv(attn_cls.__dict__["expand_kv"]), key=key)
    patch_attribute(idx_cls, "forward", _wrap_indexer_forward(idx_cls.__dict__["forward"], project), key=key)


def _patch_deepseek_v4(module) -> None:
    key = f"{KEY}.deepseek_v4"
    attn = _cls(module, "DeepseekV4Attention")
    idx = _cls(module, "DeepseekV4Indexer")
    csa = _cls(module, "DeepseekV4CSACompressor")
    hca = _cls(module, "DeepseekV4HCACompressor")
    patch_attribute(idx, "forward", _wrap_v4_indexer(idx.__dict__["forward"]), key=key)
    patch_attribute(attn, "forward", _wrap_v4_attention_forward(attn.__dict__["forward"]), key=key)
    for comp in (csa, hca):
        patch_attribute(
            comp, "forward", _wrap_capture(comp.__dict__["forward"], "_dsa_position_ids", "position_ids"), key=key
        )
    with _lock:
        _HANDLERS[attn] = _v4_attention
        _handler_keys.setdefault(key, []).append(attn)


def _patch_glm5_next(module) -> None:
    key = f"{KEY}.glm5_next"
    attn, idx = _cls(module, "Glm5NextTextAttention"), _cls(module, "Glm5NextTextIndexer")
    for cls, name in ((attn, "expand_kv"), (attn, "build_attention_mask_from_topk"), (idx, "forward"),
                      (idx, "get_pooled_states")):
        if name not in cls.__dict__:
            raise PatchPointMissing(f"dsa_plugins: expected {cls.__qualname__}.{name} in {module.__name__}")
    patch_attribute(attn, "expand_kv", _wrap_expand_kv(attn.__dict__["expand_kv"]), key=key)
    patch_attribute(
        attn, "build_attention_mask_from_topk", _wrap_topk_mask(attn.__dict__["build_attention_mask_from_topk"]),
        key=key,
    )
    patch_attribute(idx, "forward", _wrap_glm5_next_indexer(idx.__dict__["forward"]), key=key)


_handler_keys: dict[str, list[type]] = {}

# model_type -> (modeling module name, patch function). Only model types present in the installed
# transformers are hooked; the others are reported by `supported_models()`.
MODELS: dict[str, tuple[str, Callable]] = {
    "glm_moe_dsa": (
        "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
        lambda m: _patch_v32_family(
            m, "glm_moe_dsa", "GlmMoeDsaAttention", "GlmMoeDsaIndexer",
            _project_rope_first("apply_rotary_pos_emb_interleave"),
        ),
    ),
    "deepseek_v32": (
        "transformers.models.deepseek_v32.modeling_deepseek_v32",
        lambda m: _patch_v32_family(
            m, "deepseek_v32", "DeepseekV32Attention", "DeepseekV32Indexer",
            _project_rope_first("apply_rotary_pos_emb"),
        ),
    ),
    "deepseek_v4": ("transformers.models.deepseek_v4.modeling_deepseek_v4", _patch_deepseek_v4),
    "axk2": (
        "transformers.models.axk2.modeling_axk2",
        lambda m: _patch_v32_family(
            m, "axk2", "AXK2Attention", "AXK2Indexer", _project_rope_first("apply_rotary_pos_emb")
        ),
    ),
    "hy_v4": (
        "transformers.models.hy_v4.modeling_hy_v4",
        lambda m: _patch_v32_family(
            m, "hy_v4", "HYV4Attention", "HYV4Indexer", _project_rope_first("apply_rotary_pos_emb", rope_first=False)
        ),
    ),
    "mistral_large4": (
        "transformers.models.mistral_large4.modeling_mistral_large4",
        lambda m: _patch_v32_family(
            m, "mistral_large4", "MistralLarge4TextAttention", "MistralLarge4TextIndexer", _project_mistral_large4
        ),
    ),
    "dots3_note": (
        "transformers.models.dots3_note.modeling_dots3_note",
        lambda m: _patch_v32_family(
            m, "dots3_note", "Dots3NoteTextAttention", "Dots3NoteTextIndexer",
            _project_rope_first("apply_rotary_pos_emb_interleave"),
        ),
    ),
    "glm5_next": ("transformers.models.glm5_next.modeling_glm5_next", _patch_glm5_next),
}

# Not supported (yet), with the reason; see the README.
UNSUPPORTED: dict[str, str] = {}


def model_available(model_type: str) -> bool:
    """Whether the installed transformers ships this model type."""
    import importlib.util

    try:
        return importlib.util.find_spec(f"transformers.models.{model_type}") is not None
    except (ImportError, ValueError):
        return False


def supported_models() -> dict[str, str]:
    """model_type -> "patched" | "available" | "not in this transformers" | reason it is unsupported."""
    status = {}
    for model_type in MODELS:
        if not model_available(model_type):
            status[model_type] = "not in this transformers"
        elif any(k == f"{KEY}.{model_type}" for k in _applied()):
            status[model_type] = "patched"
        else:
            status[model_type] = "available (patched when its modeling module is imported)"
    status.update(UNSUPPORTED)
    return status


def _applied() -> list[str]:
    from ._core import applied_keys

    return applied_keys()


# --------------------------------------------------------------------------------------------
# Registration of the interfaces
# --------------------------------------------------------------------------------------------

_MISSING = object()
_saved_interfaces: dict[str, Any] = {}


def check_version() -> None:
    """Raise UnsupportedVersion unless transformers is in the tested range."""
    require_version("transformers", MIN_VERSION, BELOW_VERSION)


def register_attention(modeling_utils=None) -> None:
    """Add "dsa_tilelang" to transformers' AttentionInterface (module: transformers.modeling_utils)."""
    if modeling_utils is None:
        from transformers import modeling_utils
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None or not hasattr(interface, "_global_mapping"):
        raise PatchPointMissing("dsa_plugins: transformers.modeling_utils.AttentionInterface._global_mapping moved")
    _register_in(interface, "attention", dsa_attention_forward)


def register_mask(masking_utils=None) -> None:
    """Add "dsa_tilelang" to transformers' AttentionMaskInterface (module: transformers.masking_utils)."""
    if masking_utils is None:
        from transformers import masking_utils
    interface = getattr(masking_utils, "AttentionMaskInterface", None)
    if interface is None or not hasattr(interface, "_global_mapping"):
        raise PatchPointMissing("dsa_plugins: transformers.masking_utils.AttentionMaskInterface._global_mapping moved")
    _register_in(interface, "mask", dsa_mask)


def _register_in(interface, what: str, fn: Callable) -> None:
    with _lock:
        mapping = interface._global_mapping
        if mapping.get(ATTN_NAME) is fn:
            return
        if what not in _saved_interfaces:
            _saved_interfaces[what] = (interface, mapping.get(ATTN_NAME, _MISSING))
        interface.register(ATTN_NAME, fn)


def unregister_interfaces() -> None:
    with _lock:
        for what, (interface, previous) in list(_saved_interfaces.items()):
            if previous is _MISSING:
                interface._global_mapping.pop(ATTN_NAME, None)
            else:
                interface._global_mapping[ATTN_NAME] = previous
        _saved_interfaces.clear()


def interfaces_registered() -> bool:
    return {"attention", "mask"} <= set(_saved_interfaces)


def patch_model(model_type: str, module=None) -> None:
    """Apply the patches of one model type to its modeling module (imported here when not given)."""
    if model_type not in MODELS:
        if model_type in UNSUPPORTED:
            raise NotImplementedError(f"dsa_plugins: {model_type} is not supported: {UNSUPPORTED[model_type]}")
        raise KeyError(f"dsa_plugins: unknown model type {model_type!r}; known: {sorted(MODELS)}")
    name, patch = MODELS[model_type]
    if module is None:
        import importlib

        module = importlib.import_module(name)
    patch(module)


def unpatch_all() -> int:
    """Revert every transformers patch of dsa_plugins. Returns how many attributes were restored."""
    with _lock:
        for classes in _handler_keys.values():
            for cls in classes:
                _HANDLERS.pop(cls, None)
        _handler_keys.clear()
    unregister_interfaces()
    return revert_patches(f"{KEY}.", prefix=True)


__all__ = [
    "ATTN_NAME",
    "MODELS",
    "UNSUPPORTED",
    "DenseMask",
    "LazyMask",
    "TopkSelection",
    "UnsupportedVersion",
    "as_mask",
    "check_version",
    "dsa_attention_forward",
    "dsa_mask",
    "glm5_next_select",
    "mask_indices",
    "model_available",
    "patch_model",
    "register_attention",
    "register_mask",
    "select_topk",
    "supported_models",
    "unique_key_columns",
    "unpatch_all",
    "unregister_interfaces",
]
