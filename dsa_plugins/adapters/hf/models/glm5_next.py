"""GLM-5.3 (glm5_next) under ``dsa_tilelang``: NoPE MLA with a k-pool indexer whose top-k is the
attention mask.

* ``Glm5NextTextAttention.expand_kv`` keeps the latent (absorbed sparse MLA, as the V3.2 family);
* ``Glm5NextTextIndexer.forward`` scores the compressed pools through ``indexer_topk``
  (:func:`glm5_next_select`: no ``[B, S, T]`` visibility or score tensors);
* ``build_attention_mask_from_topk`` returns a :class:`~..masks.TopkSelection` (the unique key
  columns) instead of the ``[B, 1, S, T]`` mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .... import ops
from ....common.settings import warn_once
from ....patches.attributes import class_in, own_attributes, patch_attribute
from ..attention import wrap_expand_kv
from ..constants import ATTN_NAME, PATCH_KEY
from ..binding import CallBinder
from ..indexer import indexer_binder, indexer_cache
from ..masks import TopkSelection, first_true, unique_key_columns

__all__ = ["glm5_next_select", "patch"]


def _wrap_topk_mask(original: Callable) -> Callable:
    bind = CallBinder(original)

    @functools.wraps(original)
    def build_attention_mask_from_topk(self, *args, **kwargs):
        if self.config._attn_implementation != ATTN_NAME:
            return original(self, *args, **kwargs)
        a = bind((self, *args), kwargs)
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
    select_k = int(indexer.index_topk) // P
    # The model drops the pools no sequence can use, so n_pools depends on the data: inside a compiled graph it
    # has no value to branch on (fullgraph=True failed here). There the op takes every slot and gives -1 for
    # those beyond a row's pools (its windows hold at most n_pools of them): the same set per row.
    if not torch.compiler.is_compiling():
        select_k = min(select_k, n_pools)
    if select_k > 0:
        # valid pools first (stable: still in order of their last key), invalid ones pushed past every query
        last = torch.where(pool_valid, pool_indices[..., -1], torch.full_like(pool_indices[..., -1], T))
        last, order = last.sort(dim=-1, stable=True)
        count = torch.searchsorted(last, q_pos, right=True)  # [B, S] pools closed at or before the query
        keys = pool_keys.gather(1, order[..., None].expand(B, n_pools, Di))
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (Hi**-0.5) * indexer.softmax_scale  # relu(c*x) = c*relu(x) for c > 0
        start = torch.zeros_like(count)
        local = ops.indexer_topk(q, keys.to(q.dtype), w, select_k, start, count)  # positions in `order`
        picked = local >= 0
        # a column in front of each (pool -1), where unpicked slots point: a compiled graph gets here with no pool
        # at all, and no gather may then read column 0 of an empty tensor
        order = torch.nn.functional.pad(order, (1, 0), value=-1)
        pool = order.gather(1, torch.where(picked, local.long() + 1, 0).view(B, -1))
        # a valid pool holds P consecutive key columns starting at its first one
        first_cols = torch.nn.functional.pad(pool_indices[..., 0].to(torch.int32), (1, 0), value=-1)
        first_col = first_cols.gather(1, pool + 1).view(B, S, select_k, 1)
        cols = first_col + torch.arange(P, device=device, dtype=torch.int32)
        cols = cols.masked_fill(~picked[..., None], -1).flatten(-2)
    else:
        cols = torch.full((B, S, 0), -1, dtype=torch.int32, device=device)

    width = int(indexer.index_topk)
    parts = [cols]
    if indexer.index_kpool_always_select_tail and P > 1:
        width += P - 1
        first = first_true(valid_keys)  # T where a sequence has no valid key
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


def _wrap_indexer(original: Callable) -> Callable:
    bind = indexer_binder(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        a = bind((self, *args), kwargs)
        cache = indexer_cache(a)
        mask = a.get("attention_mask")
        if (
            self.config._attn_implementation != ATTN_NAME
            or not isinstance(mask, torch.Tensor)
            or mask.dim() != 2
        ):
            return original(self, *args, **kwargs)
        if not self.index_kpool_always_select_tail and self.index_kpool > 1:
            warn_once(
                "hf:glm5_next_tail",
                "dsa_tilelang: glm5_next with index_kpool_always_select_tail=False: the first index_kpool - 1 "
                "tokens of a sequence select no key; the sparse path gives them zeros, eager averages every "
                "key of the batch row (future and padding included), so the outputs differ from eager",
            )
        with torch.no_grad():
            return glm5_next_select(self, a["hidden_states"], a["q_resid"], mask, cache)

    return forward


def patch(module) -> None:
    """Patch ``transformers.models.glm5_next.modeling_glm5_next``."""
    key = f"{PATCH_KEY}.glm5_next"
    attn, idx = class_in(module, "Glm5NextTextAttention"), class_in(module, "Glm5NextTextIndexer")
    expand_kv, topk_mask = own_attributes(attn, "expand_kv", "build_attention_mask_from_topk")
    forward, _ = own_attributes(idx, "forward", "get_pooled_states")  # glm5_next_select calls the latter
    patch_attribute(attn, "expand_kv", wrap_expand_kv(expand_kv), key=key)
    patch_attribute(attn, "build_attention_mask_from_topk", _wrap_topk_mask(topk_mask), key=key)
    patch_attribute(idx, "forward", _wrap_indexer(forward), key=key)
