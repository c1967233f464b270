"""The attention mask under ``dsa_tilelang``: a description, materialised only when a dense
fallback needs it.

transformers asks ``AttentionMaskInterface["dsa_tilelang"]`` (:func:`dsa_mask`) for the mask and
hands the result to the indexer and the attention function. Ours is a :class:`LazyMask`: the
sizes, offsets, padding and mask function, answering in O(S) the two questions the sparse path
asks (each row's window of visible key columns, and whether given columns are allowed) instead of
a ``[B, 1, S, T]`` tensor. :class:`TopkSelection` is what glm5_next's top-k mask becomes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .constants import refuse_unsupported

__all__ = [
    "DenseMask",
    "LazyMask",
    "PLAIN_SLIDING_CODE",
    "TopkSelection",
    "as_mask",
    "dsa_mask",
    "mask_indices",
    "patch_sliding_mask_function",
    "unique_key_columns",
]


def _is_head_slice(key) -> bool:
    """``[:, 0]`` or ``[:, 0, :, :]``: the models drop the (size-1) head axis before the indexer."""
    if not isinstance(key, tuple) or len(key) not in (2, 4):
        return False
    first, head, *rest = key
    full = lambda k: isinstance(k, slice) and k.start is None and k.stop is None and k.step is None
    return full(first) and type(head) is int and head == 0 and all(full(k) for k in rest)


def _plain_sliding(overlay: Callable, causal: Callable) -> Callable:
    def dsa_plain_sliding_causal(batch_idx, head_idx, q_idx, kv_idx):
        return overlay(batch_idx, head_idx, q_idx, kv_idx) & causal(batch_idx, head_idx, q_idx, kv_idx)

    return dsa_plain_sliding_causal


#: the code of every plain sliding causal mask function :func:`patch_sliding_mask_function` makes transformers build:
#: what the lazy mask recognises it by (a wrapper, even one that copies its name, has code of its own)
PLAIN_SLIDING_CODE = _plain_sliding(None, None).__code__


def patch_sliding_mask_function(masking_utils) -> None:
    """Patch ``transformers.masking_utils`` (reversibly): its ``sliding_window_causal_mask_function`` gives the same
    mask (the sliding window overlay and causality) as a closure whose code is :data:`PLAIN_SLIDING_CODE`, instead
    of transformers' ``and_masks(...)``, which a custom or packed mask also is. Its code is what ``torch.compile``
    can compare (tracing a forward it cannot look into a closure's cells), so :attr:`LazyMask.is_simple` keeps
    compiled sliding layers on the O(S) windows instead of an O(S * T) dense mask (``fullgraph=True`` had failed on
    DeepSeek-V4 there). The same values for every model: a performance patch."""
    from ...patches.attributes import PatchPointMissing, patch_attribute
    from .constants import PATCH_KEY

    overlay_of = getattr(masking_utils, "sliding_window_overlay", None)
    causal = getattr(masking_utils, "causal_mask_function", None)
    if overlay_of is None or causal is None:
        raise PatchPointMissing("dsa_plugins: transformers.masking_utils.sliding_window_overlay or "
                                "causal_mask_function moved (the sliding mask patch)")

    def sliding_window_causal_mask_function(sliding_window: int) -> Callable:
        return _plain_sliding(overlay_of(sliding_window), causal)

    patch_attribute(masking_utils, "sliding_window_causal_mask_function", sliding_window_causal_mask_function,
                    key=f"{PATCH_KEY}.masks")


def _is_plain_sliding(fn, causal) -> bool:
    """The sliding window causal mask and nothing else (no packing, no extra and/or functions): the function
    :func:`patch_sliding_mask_function` makes transformers build, or (eager only) transformers' own
    ``and_masks(sliding_window_overlay(W), causal_mask_function)``, recognised from its closure. Inside a
    compiled graph no closure can be read: any other function takes the dense mask there (correct for any mask)."""
    if getattr(fn, "__code__", None) is PLAIN_SLIDING_CODE:
        return True
    if torch.compiler.is_compiling() or not getattr(fn, "__qualname__", "").startswith("and_masks."):
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


def first_true(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's first True (the row length where none), int64 [...]. A minimum over the column
    numbers, not ``argmax`` over the row as int8: under torch.compile on the GPU (torch 2.11, inductor's Triton
    code) that argmax came back wrapped to int8 (columns 682 / 1365 / 2048 as -86 / 85 / 0; eager and CPU inductor
    right), so a compiled left-padded generation step took windows that began inside the sequences' tokens."""
    cols = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), cols, mask.shape[-1]).amin(-1)  # (a dense mask from a long 2D mask is long)


def last_true(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last True (-1 where none), int64 [...] (see ``first_true``)."""
    cols = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), cols, -1).amax(-1)


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
        # A static cache passes its length counter itself, which the attention layers advance in place
        # before the indexer reads the mask: keep the value it had when the mask was made.
        self.q_offset = q_offset.clone() if isinstance(q_offset, torch.Tensor) else q_offset
        self.kv_offset = int(kv_offset)
        self.mask_function = mask_function
        need = self.kv_offset + self.kv_length
        if attention_mask is not None and attention_mask.shape[-1] < need:
            # keys past the 2D mask are masked, as transformers does. Padded here, when the mask is made: a static
            # cache's 2D mask grows by a column every step, and a compiled forward handed this mask (generate
            # makes it before the forward) would see a new input shape per step (a recompile, a CUDA graph per
            # length); the cache's whole length is one shape
            attention_mask = torch.nn.functional.pad(attention_mask, (0, need - attention_mask.shape[-1]), value=0)
        self.padding = attention_mask
        self.local_size = local_size
        self.use_vmap = use_vmap
        self.device = torch.device(device)
        self._dense: torch.Tensor | None = None
        self._windows: tuple[torch.Tensor, torch.Tensor] | None = None
        self._local_padding: torch.Tensor | None = None
        self._holes: bool | None = None  # has_holes' answer: one host read per mask, however many layers ask

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

    def query_positions(self, shift: int = 0) -> torch.Tensor:
        """Absolute position of every query row (plus ``shift``), [S] int64."""
        offset = self.q_offset
        if isinstance(offset, torch.Tensor):
            offset = offset.to(self.device, torch.long)
            return torch.arange(shift, self.q_length + shift, device=self.device, dtype=torch.long) + offset
        return torch.arange(offset + shift, offset + shift + self.q_length, device=self.device, dtype=torch.long)

    def local_padding(self) -> torch.Tensor | None:
        """The 2D padding mask over this mask's key columns, [B, T] bool (None: no padding)."""
        if self.padding is None:
            return None
        if self._local_padding is None:  # one mask serves every layer of a forward: converted once
            pad = self.padding.to(self.device).bool()  # covers every key column (padded when the mask was made)
            self._local_padding = pad[:, self.kv_offset : self.kv_offset + self.kv_length]
        return self._local_padding

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
            # bool whatever the 2D mask's dtype (a custom mask function over a long one makes a long mask)
            self._dense = mask.bool().expand(self.batch_size, 1, self.q_length, self.kv_length)
        return self._dense

    def windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row, key columns ``[start, end)`` it may see: two [B, S] int64 tensors with
        0 <= start <= end <= kv_length. A causal mask without padding takes four small launches (a
        generation step pays each one's host time)."""
        if self._windows is not None:
            return self._windows
        B, S, T = self.batch_size, self.q_length, self.kv_length
        if self.is_simple:
            last = self.query_positions(1 - self.kv_offset)  # one past each row's last visible key
            end = last.clamp(0, T)
            start = (last - int(self.local_size)).clamp_(0, T) if self.local_size is not None else torch.zeros_like(end)
            start, end = start.expand(B, S), end.expand(B, S)
            pad = self.local_padding()
            if pad is not None:
                first = first_true(pad)  # T where a row allows nothing
                start = torch.maximum(start, first[:, None])
                end = torch.maximum(end, start)
        else:
            d = self.dense()[:, 0]
            end = last_true(d) + 1  # 0 where a row allows nothing
            start = torch.minimum(first_true(d), end)
        self._windows = (start.contiguous(), end.contiguous())
        return self._windows

    def has_holes(self) -> bool:
        """True when some row's allowed keys are not one contiguous range (padding with gaps): a masked key
        between two allowed ones. Masked keys after a row's last allowed one are no gap (a static cache's
        columns past the tokens so far: the causal window ends before them)."""
        if not self.is_simple:
            return True
        if self._holes is None:
            pad = self.local_padding()
            if pad is None:
                self._holes = False
            else:
                seen = pad.to(torch.int8)
                after_first = seen.cummax(-1).values.bool()
                before_last = seen.flip(-1).cummax(-1).values.flip(-1).bool()
                self._holes = bool((after_first & before_last & ~pad).any())
        return self._holes

    def allowed(self, idx: torch.Tensor) -> torch.Tensor:
        """Whether key columns ``idx`` [B, S, k] (any integer dtype) are allowed for their query rows
        (bool [B, S, k])."""
        T = self.kv_length
        if T == 0:
            return torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        if self.is_simple:
            start, end = self.windows()
            # inside the row's window, which lies in [0, T]: in range too (a generation step with padding
            # asks this every step: three launches, not eight)
            ok = (idx >= start[..., None]) & (idx < end[..., None])
            pad = self.local_padding()
            if pad is not None:
                B = idx.shape[0]
                safe = idx.clamp(0, T - 1).long()
                ok &= pad.gather(1, safe.reshape(B, -1)).view_as(idx)
            return ok
        safe = idx.clamp(0, T - 1).long()
        return (idx >= 0) & (idx < T) & self.dense()[:, 0].gather(-1, safe)


class DenseMask(LazyMask):
    """A user-supplied 4D tensor mask (bool, or additive float) behind the LazyMask interface."""

    def __init__(self, mask: torch.Tensor, q_offset: int | None = None):
        B, _, S, T = mask.shape
        super().__init__(B, S, T, q_offset=(T - S) if q_offset is None else q_offset, device=mask.device)
        if mask.dtype != torch.bool:
            allowed = mask > torch.finfo(mask.dtype).min / 2
            # the sparse path adds no bias: an additive mask may only say "allowed" (0) or "not" (its dtype's
            # minimum, -inf); other values would be dropped silently (checked eagerly: one host read)
            if not torch.compiler.is_compiling() and bool((allowed & (mask != 0)).any()):
                raise ValueError(
                    "dsa_tilelang: the additive attention mask holds values other than 0 and the dtype's minimum "
                    "(a bias), which the sparse attention cannot add; pass a boolean mask or a 0 / -inf one, or run "
                    "this call with attn_implementation='eager'")
            mask = allowed
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
    refuse_unsupported(getattr(kwargs.pop("config", None), "model_type", None))
    return LazyMask(batch_size, q_length, kv_length, **kwargs)


def mask_indices(indices: torch.Tensor, mask: LazyMask) -> torch.Tensor:
    """Map indices the mask forbids to -1 (int32 out; an allowed index is below kv_length, so it fits)."""
    return torch.where(mask.allowed(indices), indices, -1).to(torch.int32)


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
