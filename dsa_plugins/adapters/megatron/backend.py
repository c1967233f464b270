"""dsa_plugins as a DSA kernel backend of megatron-core >= 0.19 (``dsa_kernel_backend="dsa_plugins"``).

megatron 0.19's own DSA (``DSAttention`` with ``AbsorbedMLASelfAttention``) asks its selected
backend module for four hooks (``experimental_attention_variant/dsa_kernels.py``); this module is
that backend. A hook that returns None hands the call back to megatron's torch path, so
everything this module declines still works, slowly:

* :func:`run_fused_dsa_attention` (tried first, every layer that computes its own top-k): the
  indexer top-k (``ops.indexer_topk``), the absorbed sparse MLA (``ops.sparse_attention`` over the
  latent) with, in training, the sparse indexer KL loss fused into the attention's backward
  (``ops.FusedIndexerLoss``: its target is the probabilities the backward recomputes anyway), and
  the ``up_v`` projection. Its gradient scale is megatron's ``DSAIndexerLossAutoScaler`` scale,
  read at backward time; under tensor parallelism the head-summed target is all-reduced over TP
  first (megatron's target exactly). Since the loss value exists only once the backward ran, the
  forward hands megatron a zero (its tracker adds it) and the backward adds the value to the
  layer's slot of megatron's tracker. The dense (warm-up) stage keeps the sparse attention and
  adds the KL loss over every key of the windows (``ops.indexer_kl_loss`` with windows: the kernels in
  chunks of rows, never [S, S]), returned to megatron, which logs it and scales its gradient.
  Declined: the dense loss under tensor parallelism, non-absorbed MLA, no ReLU in the scores,
  explicit key positions or masks.
* :func:`run_fused_qk_topk`: the top-k alone (no loss: eval, coefficient 0).
* :func:`run_fused_qk_topk_with_loss`: top-k and the standalone sparse loss (layers whose full
  hook declined), padding rows and per-token losses as megatron reduces them (row weights);
  declined under tensor parallelism (the standalone op has no TP group).
* :func:`run_fused_absorbed_sparse_attention`: attention over given indices (top-k sharing layers).

Masks reach the hooks as per-row key windows ``[start, end)`` over the (CP-gathered, reordered)
keys, which is what ``indexer_topk`` takes: context parallel and packed sequences need nothing
more. Megatron's layouts are ``[s, b, ...]``; the ops take ``[b, s, ...]``.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Optional

import torch

from ... import ops
from ...common.settings import warn_once
from .layers import deterministic_for

# The DSAttention module whose forward is running (set by the patch in spec_patches / register):
# the hooks get no layer number, which the loss logging needs.
CURRENT_LAYER: contextvars.ContextVar = contextvars.ContextVar("dsa_plugins_megatron_layer", default=None)


def track_layer(forward):
    """Wrap ``DSAttention.forward`` so that the hooks know which layer runs (for the loss tracker), and
    run it under :func:`dsa_plugins.deterministic` where megatron's config sets ``deterministic_mode``."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        token = CURRENT_LAYER.set(self)
        try:
            with deterministic_for(self.config):
                return forward(self, *args, **kwargs)
        finally:
            CURRENT_LAYER.reset(token)

    return wrapper


def _batch_major(t: torch.Tensor) -> torch.Tensor:
    """[s, b, ...] -> [b, s, ...] (contiguous)."""
    return t.transpose(0, 1).contiguous()


def _select(q, k, weights, index_topk: int, starts, ends, return_lse: bool = False):
    """Top-k key positions [b, sq, K] int32 (-1 padded) for q [sq, b, nh, hd], k [skv, b, hd],
    weights [sq, b, nh] and windows ``starts``/``ends`` [sq] shared by the batch. ``return_lse``: also
    the logsumexp of each row's selected scores, [b * sq] fp32 (batch-major like the loss's rows), which
    spares the sparse indexer loss its own pass over the logits."""
    skv = k.shape[0]
    with torch.no_grad():
        result = ops.indexer_topk(_batch_major(q), _batch_major(k).to(q.dtype), _batch_major(weights),
                                  min(int(index_topk), skv), starts, ends, return_lse=return_lse)
    return (result[0], result[1].reshape(-1)) if return_lse else result


def _tp_group(pg_collection):
    group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return group if group is not None and group.size() > 1 else None


def _row_weights(query_valid_rows, b: int, sq: int, per_token: bool, device) -> Optional[torch.Tensor]:
    """Megatron's reduction of the per-row KL as row weights [b * sq] (batch-major): the mean over
    real rows (all rows without ``query_valid_rows``), or their plain sum for per-token losses."""
    if query_valid_rows is None:
        return torch.ones(b * sq, device=device) if per_token else None
    valid = query_valid_rows.reshape(b, sq).to(device=device, dtype=torch.float32).reshape(-1)
    return valid if per_token else valid / valid.sum().clamp_min(1.0)


def _decline(reason: str) -> None:
    warn_once(f"megatron-backend:{reason}",
              f"dsa_plugins megatron backend: {reason}; megatron's torch path runs these layers (slow)")


def _log_to_tracker(layer, coeff: float):
    """A FusedIndexerLoss callback: add coeff * value to ``layer``'s slot of megatron's tracker."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    cp = getattr(layer.pg_collection, "cp", None)
    cp_size = cp.size() if cp is not None else 1
    per_token = layer.config.calculate_per_token_loss

    def log(value):
        DSAIndexerLossLoggingHelper.save_loss_to_tracker(
            loss=value.detach().float() * coeff, layer_number=layer.layer_number, num_layers=layer.config.num_layers,
            reduce_group=cp if cp_size > 1 and per_token else None,
            avg_group=cp if cp_size > 1 and not per_token else None,
        )

    return log


def _loss_scale(coeff: float):
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    def weight():
        scale = DSAIndexerLossAutoScaler.main_loss_backward_scale
        return coeff * (scale if scale is not None else 1.0)

    return weight


def _attention(query, key, topk_indices, softmax_scale, v_channels, indexer_loss=None) -> torch.Tensor:
    """Latent attention [sq, b, np, v_channels] of query [sq, b, np, D] over key [skv, b, 1, D]."""
    out = ops.sparse_attention(_batch_major(query), _batch_major(key[:, :, 0]), topk_indices, softmax_scale,
                               dv=int(v_channels), indexer_loss=indexer_loss)
    return out.transpose(0, 1)


def _packed_loss_inputs(q_indexer, k_indexer, weights, query, key) -> tuple:
    """The indexer loss's inputs in the packed layout, batch-major rows (b * sq query rows, b * skv
    key rows): index_q, index_k, weights (fp32), and the detached attention query and kv latent."""
    sq, b = q_indexer.shape[:2]
    skv = k_indexer.shape[0]
    return (_batch_major(q_indexer).reshape(b * sq, *q_indexer.shape[2:]),
            _batch_major(k_indexer).reshape(b * skv, -1).to(q_indexer.dtype),
            _batch_major(weights).reshape(b * sq, -1).float(),
            _batch_major(query.detach()).reshape(b * sq, *query.shape[2:]),
            _batch_major(key.detach()[:, :, 0]).reshape(b * skv, -1))


def _dense_indexer_loss(q_indexer, k_indexer, weights, query, key, softmax_scale, starts, ends, row_weights):
    """The dense (warm-up) KL loss over the windows, differentiable in the indexer's q, k and weights:
    the batch flattened to rows (batch-major), each batch element's windows shifted to its keys."""
    sq, b = q_indexer.shape[:2]
    skv = k_indexer.shape[0]
    shift = (torch.arange(b, device=starts.device, dtype=torch.int64) * skv).view(b, 1)
    key_start = (starts.to(torch.int64).view(1, sq) + shift).reshape(-1)
    key_end = (ends.to(torch.int64).view(1, sq) + shift).reshape(-1)
    return ops.indexer_kl_loss(*_packed_loss_inputs(q_indexer, k_indexer, weights, query, key), None, softmax_scale,
                               key_start=key_start, key_end=key_end, row_weights=row_weights)


# ----------------------------------------------------------------------------- the hooks


def run_fused_dsa_attention(*, config, query, key, value, up_v_weight, q_indexer, k_indexer, indexer_weights,
                            indexer_topk, softmax_scale, loss_coeff, sparse_loss, calculate_per_token_loss,
                            absorbed_mla, cp_size, attn_mask_type, packed_seq_params, varlen_starts, varlen_ends,
                            key_positions, query_valid_rows, varlen_is_plain_causal=False, use_relu,
                            use_local_indexer_varlen=False, single_packed_thd_sequence=False,
                            local_packed_cp_rank=0, local_packed_cp_query_start=0, local_packed_cp_query_len=None,
                            pg_collection=None):
    """The whole DSA core attention: top-k, absorbed sparse MLA (+ fused sparse loss), up_v.
    Returns (output [sq, b, np * v_head_dim], loss placeholder) or None (declined)."""
    if not absorbed_mla or value is not None or up_v_weight is None:
        return None  # megatron's non-absorbed MLA path: per-head K/V
    if not use_relu:
        return _decline("indexer scores without ReLU are not supported")
    if varlen_starts is None or varlen_ends is None or key_positions is not None:
        return _decline("masks other than per-row key windows are not supported")
    dense_loss = loss_coeff > 0 and not sparse_loss
    if dense_loss and _tp_group(pg_collection) is not None:
        return _decline("the dense indexer loss under tensor parallelism is not supported")
    sq, b, np_, _ = query.shape
    sparse_loss_on = loss_coeff > 0 and not dense_loss  # its loss takes the selection's lse
    selected = _select(q_indexer, k_indexer, indexer_weights, indexer_topk, varlen_starts, varlen_ends,
                       return_lse=sparse_loss_on)
    topk, index_lse = selected if sparse_loss_on else (selected, None)
    if dense_loss:  # warm-up: sparse attention, the indexer loss over every key of the windows
        latent = _attention(query, key, topk, softmax_scale, up_v_weight.shape[-1])
        output = torch.einsum("sbhc,hdc->sbhd", latent, up_v_weight.to(latent.dtype)).reshape(sq, b, -1)
        kl = _dense_indexer_loss(q_indexer, k_indexer, indexer_weights, query, key, softmax_scale, varlen_starts,
                                 varlen_ends, _row_weights(query_valid_rows, b, sq, calculate_per_token_loss,
                                                           query.device))
        return output, kl * float(loss_coeff)  # megatron logs it and scales its gradient
    loss = None
    if loss_coeff > 0:
        layer = CURRENT_LAYER.get()
        skv = k_indexer.shape[0]
        loss = ops.FusedIndexerLoss(
            _batch_major(q_indexer).reshape(b * sq, *q_indexer.shape[2:]),
            _batch_major(k_indexer).reshape(b * skv, -1).to(q_indexer.dtype),
            _batch_major(indexer_weights).reshape(b * sq, -1).float(),
            weight=_loss_scale(float(loss_coeff)),
            on_value=None if layer is None else _log_to_tracker(layer, float(loss_coeff)),
            row_weights=_row_weights(query_valid_rows, b, sq, calculate_per_token_loss, query.device),
            target_group=_tp_group(pg_collection), index_lse=index_lse,
        )
        if layer is None:
            warn_once("megatron-backend:no-layer", "dsa_plugins megatron backend: DSAttention.forward is not "
                      "tracked (register() was bypassed): the indexer loss trains but is not logged")
    latent = _attention(query, key, topk, softmax_scale, up_v_weight.shape[-1], indexer_loss=loss)
    output = torch.einsum("sbhc,hdc->sbhd", latent, up_v_weight.to(latent.dtype)).reshape(sq, b, -1)
    placeholder = torch.zeros((), device=query.device, dtype=torch.float32)  # the value is logged by the backward
    return output, placeholder


def run_fused_qk_topk(q, k, weights, index_topk, starts, ends, block_size, use_relu=True,
                      use_local_indexer_varlen=False, single_packed_thd_sequence=False, local_packed_cp_rank=0,
                      local_packed_cp_query_start=0, local_packed_cp_query_len=None, packed_seq_params=None,
                      cp_size=1):
    """(topk_indices [b, sq, K] int32, None) or None."""
    if not use_relu:
        return _decline("indexer scores without ReLU are not supported")
    return _select(q, k, weights, index_topk, starts, ends), None


def run_fused_qk_topk_with_loss(config, q, k, weights, index_topk, starts, ends, block_size, query, key,
                                softmax_scale, loss_coeff, pg_collection, query_valid_rows=None,
                                calculate_per_token_loss=False, use_relu=True, use_local_indexer_varlen=False,
                                single_packed_thd_sequence=False, local_packed_cp_rank=0,
                                local_packed_cp_query_start=0, local_packed_cp_query_len=None,
                                packed_seq_params=None, cp_size=1):
    """(topk_indices, None, loss_coeff * sparse KL with gradients to q, k, weights) or None."""
    if not use_relu:
        return _decline("indexer scores without ReLU are not supported")
    sq, b = q.shape[:2]
    if _tp_group(pg_collection) is not None or key.shape[2] != 1:
        return None  # the standalone op has no TP group (the full hook all-reduces the target)
    topk, index_lse = _select(q, k, weights, index_topk, starts, ends, return_lse=True)
    skv = k.shape[0]
    base = (torch.arange(b, device=q.device, dtype=torch.int32) * skv).view(b, 1, 1)
    rows = torch.where(topk >= 0, topk + base, -1).reshape(b * sq, -1)
    kl = ops.indexer_kl_loss(*_packed_loss_inputs(q, k, weights, query, key), None, softmax_scale,
                             topk_indices=rows,
                             row_weights=_row_weights(query_valid_rows, b, sq, calculate_per_token_loss, q.device),
                             index_lse=index_lse)
    return topk, None, kl * float(loss_coeff)


def run_fused_absorbed_sparse_attention(query, key, topk_indices, softmax_scale, v_channels, topk_length=None):
    """Latent output [sq, b, np, v_channels] (differentiable in query and key) or None."""
    if key.dim() != 4 or key.shape[2] != 1:
        return None
    if topk_length is not None:  # a left-compacted prefix of valid slots
        slot = torch.arange(topk_indices.shape[-1], device=topk_indices.device)
        topk_indices = torch.where(slot < topk_length.unsqueeze(-1), topk_indices, -1)
    return _attention(query, key, topk_indices, softmax_scale, v_channels)


__all__ = [
    "CURRENT_LAYER",
    "run_fused_absorbed_sparse_attention",
    "run_fused_dsa_attention",
    "run_fused_qk_topk",
    "run_fused_qk_topk_with_loss",
    "track_layer",
]
