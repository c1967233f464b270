"""DeepSeek-V4 under ``dsa_tilelang``: sliding-window rows plus compressed rows, with sinks.

The model's own code still builds everything but the scores: the CSA indexer's compressed keys
and rope'd queries are captured at its scorer and selected through the fused ``indexer_topk``
(no O(S * T/4 * heads) score tensor); the result and the compressors' positions are kept on the
modules for the call; the attention handler :func:`v4_attention` gathers the sliding-window rows
plus the selected (CSA) or causally visible (HCA) compressed rows into one ``sparse_attention``
with the per-head sink. Known cost left: the CSA/HCA compressors still build their ``block_bias``
([B, 1, S, T/ratio]), which the sparse path ignores.

With a :class:`~.deepseek_v4_cache.DsaV4StaticCache` (what ``generate(cache_implementation="static")`` makes for V4
under dsa_tilelang) the compressors and the indexer run on its fixed buffers instead of transformers' growing ones
(:func:`~.deepseek_v4_cache.compress_static`), and the handler maps positions onto its ring and entry rows.
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

#: :mod:`.deepseek_v4_cache` (it imports transformers' cache classes), bound by :func:`patch`
_cache = None

__all__ = ["patch", "v4_attention"]


class _ScoresCaptured(Exception):
    """Raised by :class:`_CaptureScorer` to stop DeepseekV4Indexer.forward before it scores densely; its args are
    the queries and the compressed keys. No ``__init__`` of its own: torch.compile traces a raise and an except
    of a plain exception class, not a ``super().__init__`` (``fullgraph=True`` failed there)."""


class _CaptureScorer(torch.nn.Module):
    """Stands in for ``DeepseekV4Indexer.scorer`` for one call: receives the rope'd queries and the
    compressed keys (the model's own code computed them and updated its cache) and stops there."""

    def forward(self, q, compressed_kv, hidden_states):
        raise _ScoresCaptured(q, compressed_kv)


def _select(indexer, q: torch.Tensor, keys: torch.Tensor, hidden_states, position_ids, n_entries) -> torch.Tensor:
    """The indexer's top-k compressed rows through ``indexer_topk``: q [B, S, Hi, Di], keys [B, T, Di] (rows past
    ``n_entries``, an int or a 0-d tensor, are not entries yet); a query at position p sees the entries of the
    windows closed by p + 1, as transformers' indexer. int32 [B, S, k], -1 where fewer are visible."""
    B, S = q.shape[:2]
    T = keys.shape[1]
    scorer = indexer._modules["scorer"]
    with torch.no_grad():
        w = scorer.weights_proj(hidden_states).float() * scorer.weights_scaling * scorer.softmax_scale
        visible = torch.clamp((position_ids.to(q.device) + 1) // indexer.compress_rate, min=0)
        visible = torch.minimum(visible, torch.as_tensor(n_entries, device=q.device)).expand(B, S)
        start = torch.zeros_like(visible)
        return ops.indexer_topk(q, keys.to(q.dtype), w, min(int(indexer.index_topk), T), start, visible)


def _static_indexer(indexer, layer, hidden_states, q_residual, position_ids) -> torch.Tensor:
    """The CSA indexer over a :class:`DsaV4StaticLayer`: its compressed keys from the fixed buffers, its queries as
    transformers' indexer makes them (rope at the query positions), the top-k through ``indexer_topk``."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    keys, n_entries = _cache.compress_static(layer, "indexer", indexer, hidden_states, overlap=True)
    B, S, _ = hidden_states.shape
    cos, sin = indexer.rotary_emb(hidden_states, position_ids=position_ids, layer_type=indexer.rope_layer_type)
    q = indexer.q_b_proj(q_residual).view(B, S, -1, indexer.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)
    return _select(indexer, q, keys, hidden_states, position_ids, n_entries)


def _cache_arg(bind: CallBinder) -> str:
    """The cache parameter's name: ``cache`` (transformers 5.24) or ``past_key_values`` (5.17)."""
    return "cache" if "cache" in bind.names else "past_key_values"


def _static_layer_of(cache, layer_idx):
    """The :class:`DsaV4StaticLayer` of this call (None for transformers' own caches)."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx is not None else None
    return layer if getattr(layer, "dsa_v4_static", False) else None


def _wrap_v4_indexer(original: Callable) -> Callable:
    """DeepSeek-V4 CSA indexer through ``indexer_topk``: the model's code builds the compressed keys
    and queries; the O(S * T/4 * heads) score tensor and its top-k are replaced by the fused op.
    The result (top-k compressed rows, -1 where not yet visible) is kept on the module for the
    attention function, as in eager mode it is turned into a block bias by the CSA compressor.
    With a :class:`DsaV4StaticCache` the keys come from its fixed buffers (:func:`_static_indexer`)."""
    bind = CallBinder(original, aliases=("cache", "past_key_values"))

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if getattr(self, "_dsa_active", False) is not True:
            out = original(self, *args, **kwargs)
            self._dsa_topk = out
            return out
        a = bind((self, *args), kwargs)
        layer = _static_layer_of(a[_cache_arg(bind)], a["layer_idx"])
        if layer is not None:
            out = _static_indexer(self, layer, a["hidden_states"], a["q_residual"], a["position_ids"])
            self._dsa_topk = out
            return out
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
        B, S = q.shape[:2]
        T = keys.shape[1]
        if T == 0:
            out = torch.full((B, S, 0), -1, dtype=torch.int32, device=q.device)
        else:
            out = _select(self, q, keys, a["hidden_states"], a["position_ids"], T)
        self._dsa_topk = out
        return out

    return forward


def _wrap_v4_compressor(original: Callable, overlap: bool) -> Callable:
    """A CSA (``overlap``) or HCA compressor: keeps the call's positions on the module for the attention handler;
    with a :class:`DsaV4StaticCache` it runs :func:`compress_static` (and the CSA indexer) instead, returning all
    entry rows [B, 1, n_rows, D] (the handler takes the closed ones) and no block bias."""
    bind = CallBinder(original, aliases=("cache", "past_key_values"))

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        a = bind((self, *args), kwargs)
        self._dsa_position_ids = a["position_ids"]
        cache = a[_cache_arg(bind)]
        layer = _static_layer_of(cache, a["layer_idx"])
        if layer is None:
            self._dsa_entries = None
            return original(self, *args, **kwargs)
        entries, n_entries = _cache.compress_static(layer, "compressor", self, a["hidden_states"], overlap)
        self._dsa_entries = n_entries
        indexer = getattr(self, "indexer", None)
        if indexer is not None:
            indexer(a["hidden_states"], a["q_residual"], a["position_ids"], cache, a["layer_idx"])
        if layer.step_kv is not None and a["hidden_states"].shape[1] == 1:
            entries = entries[:, :0]  # the step reads layer.step_kv: nothing for transformers to concatenate
        return entries.unsqueeze(1), None

    return forward


def _wrap_v4_attention_forward(original: Callable) -> Callable:
    """Tell the layer's CSA indexer (if any) whether this call runs under dsa_tilelang, and the attention handler
    which :class:`DsaV4StaticLayer` (if any) holds this layer's cache (refused under other implementations)."""
    bind = CallBinder(original, aliases=("cache", "past_key_values"))

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        layer = _static_layer_of(bind((self, *args), kwargs)[_cache_arg(bind)], self.layer_idx)
        active = self.config._attn_implementation == ATTN_NAME
        if layer is not None and not active:
            raise ValueError(
                "DsaV4StaticCache serves attn_implementation='dsa_tilelang' only (its window and compressed rows are "
                f"laid out for the sparse path); this model runs {self.config._attn_implementation!r}")
        self._dsa_static_layer = layer
        indexer = getattr(getattr(self, "compressor", None), "indexer", None)
        if indexer is None:
            return original(self, *args, **kwargs)
        indexer._dsa_active = active
        try:
            return original(self, *args, **kwargs)
        finally:
            indexer._dsa_active = False

    return forward


def _wrap_prepare_static_cache(original: Callable) -> Callable:
    """``generate(cache_implementation="static")`` on DeepSeek-V4 under dsa_tilelang makes a
    :class:`DsaV4StaticCache` (transformers has no static layers for V4's compressed layer types); other
    attention implementations get transformers' own behaviour."""

    @functools.wraps(original)
    def _prepare_static_cache(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs):
        if self.config._attn_implementation != ATTN_NAME:
            return original(self, cache_implementation, batch_size, max_cache_len, *args, **kwargs)
        if "offloaded" in cache_implementation:
            raise ValueError("dsa_tilelang: DeepSeek-V4's static cache cannot be offloaded; use "
                             "cache_implementation='static'")
        # the largest length so far, as transformers does: a later call that fits reuses the compiled graphs
        length = max(max_cache_len, getattr(self, "_previous_max_cache_length", -1))
        cache = _cache.DsaV4StaticCache(self.config.get_text_config(decoder=True), max_cache_len=length)
        if kwargs.get("prefill_chunk_size", args[0] if args else None) is not None:
            cache.allocate(self, batch_size)  # the chunked prefill is compiled: buffers at fixed addresses first
        self._previous_max_cache_length = length
        return cache

    return _prepare_static_cache


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
    static = getattr(module, "_dsa_static_layer", None)
    pos = mask.query_positions()
    if static is None:
        Tw = mask.kv_length
        W = int(sliding_window or mask.local_size or Tw)
        cand = (pos - mask.kv_offset)[:, None] - torch.arange(W - 1, -1, -1, device=query.device)
        cand = cand.expand(B, S, W)
        parts = [torch.where(mask.allowed(cand), cand, -1).to(torch.int32)]
    else:  # DsaV4StaticCache: keys are [ring (position p in row p % W), the S new rows, entry rows]
        W = static.window
        cand = (pos[:, None] - torch.arange(W - 1, -1, -1, device=query.device)).expand(B, S, W)  # positions
        if S == 1 and static.step_kv is not None:  # [ring (holding the new row), entry rows] in one buffer
            kv, Tw = static.step_kv, W
            row = cand.remainder(W)
        else:
            Tw = W + S
            row = torch.where(cand >= pos[0], W + cand - pos[0], cand.remainder(W))
        parts = [torch.where(mask.allowed(cand), row, -1).to(torch.int32)]
    Tc = kv.shape[1] - Tw
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
            n_entries = getattr(comp, "_dsa_entries", None)  # a static cache's closed windows (rows past: open)
            if S == 1:
                valid = torch.ones(B, S, Tc, dtype=torch.bool, device=query.device)
            else:
                position_ids = getattr(comp, "_dsa_position_ids", None)
                if position_ids is None:
                    raise RuntimeError("dsa_tilelang: DeepSeek-V4 HCA positions were not captured for this call")
                threshold = (position_ids.to(query.device) + 1) // comp.compress_rate
                valid = (rows.view(1, 1, -1) < threshold[..., None]).expand(B, S, Tc)
            if static is not None and n_entries is not None:
                valid = valid & (rows < n_entries)
            parts.append(torch.where(valid, rows + Tw, torch.full_like(rows, -1)))
    idx = torch.cat(parts, dim=-1).to(torch.int32)
    sink = s_aux.float() if s_aux is not None else None
    out = ops.sparse_attention(query.transpose(1, 2), kv, idx, scaling, sink=sink)
    return out, None


def patch(module) -> None:
    """Patch ``transformers.models.deepseek_v4.modeling_deepseek_v4``."""
    global _cache
    from . import deepseek_v4_cache as _cache
    key = f"{PATCH_KEY}.deepseek_v4"
    attn, idx = class_in(module, "DeepseekV4Attention"), class_in(module, "DeepseekV4Indexer")
    compressors = [class_in(module, name) for name in ("DeepseekV4CSACompressor", "DeepseekV4HCACompressor")]
    (attn_forward,), (idx_forward,) = own_attributes(attn, "forward"), own_attributes(idx, "forward")
    comp_forwards = [own_attributes(comp, "forward")[0] for comp in compressors]
    patch_attribute(idx, "forward", _wrap_v4_indexer(idx_forward), key=key)
    patch_attribute(attn, "forward", _wrap_v4_attention_forward(attn_forward), key=key)
    for comp, forward, overlap in zip(compressors, comp_forwards, (True, False)):
        patch_attribute(comp, "forward", _wrap_v4_compressor(forward, overlap), key=key)
    register_handler(attn, v4_attention)
    lm = getattr(module, "DeepseekV4ForCausalLM", None)
    if lm is not None and hasattr(lm, "_prepare_static_cache"):
        patch_attribute(lm, "_prepare_static_cache", _wrap_prepare_static_cache(lm._prepare_static_cache), key=key)
