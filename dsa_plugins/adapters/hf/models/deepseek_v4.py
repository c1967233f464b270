"""DeepSeek-V4 under ``dsa_tilelang``: sliding-window rows plus compressed rows, with sinks.

The model's own code still builds everything but the scores: the CSA indexer's compressed keys
and rope'd queries are captured at its scorer and selected through the fused ``indexer_topk``
(no O(S * T/4 * heads) score tensor); the result and the compressors' positions are kept on the
modules for the call; the attention handler :func:`v4_attention` gathers the sliding-window rows
plus the selected (CSA) or causally visible (HCA) compressed rows into one ``sparse_attention``
with the per-head sink. Known cost left: the CSA/HCA compressors still build their ``block_bias``
([B, 1, S, T/ratio]), which the sparse path ignores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .... import ops
from ....patches.attributes import PatchPointMissing, class_in, own_attributes, patch_attribute
from ..attention import register_handler
from ..binding import CallBinder
from ..constants import ATTN_NAME, PATCH_KEY
from ..masks import LazyMask

__all__ = ["patch", "v4_attention"]


def _wrap_keep_argument(original: Callable, attr: str, argument: str) -> Callable:
    """Wrap a forward to keep its argument ``argument`` on the module as ``attr`` for the call."""
    bind = CallBinder(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        setattr(self, attr, bind((self, *args), kwargs).get(argument))
        return original(self, *args, **kwargs)

    return forward


class _ScoresCaptured(Exception):
    """Raised by :class:`_CaptureScorer` to stop DeepseekV4Indexer.forward before it scores densely; its args are
    the queries and the compressed keys. No ``__init__`` of its own: torch.compile traces a raise and an except
    of a plain exception class, not a ``super().__init__`` (``fullgraph=True`` failed there)."""


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
    bind = CallBinder(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if getattr(self, "_dsa_active", False) is not True:
            out = original(self, *args, **kwargs)
            self._dsa_topk = out
            return out
        a = bind((self, *args), kwargs)
        scorer = self._modules["scorer"]
        self._modules["scorer"] = _CaptureScorer()
        try:
            original(self, *args, **kwargs)
        except _ScoresCaptured as captured:
            q, keys = captured.args
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
            start = torch.zeros_like(visible)
            out = ops.indexer_topk(q, keys.to(q.dtype), w, min(int(self.index_topk), T), start, visible)
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


def v4_attention(module, query, key, value, attention_mask, scaling, s_aux=None, sliding_window=None, **kwargs):
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
    parts = [torch.where(mask.allowed(cand), cand, -1).to(torch.int32)]
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
    out = ops.sparse_attention(query.transpose(1, 2), kv, idx, scaling, sink=sink)
    return out, None


def patch(module) -> None:
    """Patch ``transformers.models.deepseek_v4.modeling_deepseek_v4``."""
    key = f"{PATCH_KEY}.deepseek_v4"
    attn, idx = class_in(module, "DeepseekV4Attention"), class_in(module, "DeepseekV4Indexer")
    compressors = [class_in(module, name) for name in ("DeepseekV4CSACompressor", "DeepseekV4HCACompressor")]
    (attn_forward,), (idx_forward,) = own_attributes(attn, "forward"), own_attributes(idx, "forward")
    comp_forwards = [own_attributes(comp, "forward")[0] for comp in compressors]
    patch_attribute(idx, "forward", _wrap_v4_indexer(idx_forward), key=key)
    patch_attribute(attn, "forward", _wrap_v4_attention_forward(attn_forward), key=key)
    for comp, forward in zip(compressors, comp_forwards):
        patch_attribute(comp, "forward", _wrap_keep_argument(forward, "_dsa_position_ids", "position_ids"), key=key)
    register_handler(attn, v4_attention)
