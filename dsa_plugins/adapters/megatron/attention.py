"""DSA core attention and absorbed-MLA self-attention for Megatron-core.

:class:`DSAttention` has megatron's ``DSAttention`` constructor and ``forward`` signature and two
input modes:

- absorbed (from :class:`AbsorbedMLASelfAttention`): ``query`` [sq, b, np, c + r] already
  multiplied by W_kc, ``key`` the shared KV latent [skv, b, c + r], ``value=None`` and ``w_vc``
  [np, v_head_dim, c]; runs :func:`dsa_plugins.ops.sparse_mla`;
- per-head (from megatron's own ``MLASelfAttention``, e.g. during inference): ``query``/``key``
  [s, b, np, hn], ``value`` [s, b, np, hnv]; each head runs through ``sparse_attention`` as MQA
  with one head. Correct but slow; the training path is the absorbed one.

The indexer loss follows megatron 0.16's ``compute_dsa_indexer_loss``: KL(p || softmax(I)) with
p = main attention probabilities summed over all heads and L1-normalised, mean over query rows,
times ``config.dsa_indexer_loss_coeff``, sparse over the top-k set when
``config.dsa_indexer_use_sparse_loss`` else dense over the causal keys; attached with megatron's
``DSAIndexerLossAutoScaler`` and logged through ``DSAIndexerLossLoggingHelper``. In the sparse
stage on the absorbed path the loss is fused into the sparse attention's backward
(:class:`dsa_plugins.ops.FusedIndexerLoss`: the attention target comes from the probabilities
the backward recomputes anyway), so its value is logged from the backward; set
``fuse_indexer_loss = False`` on the module for the standalone op in the forward. Under tensor
parallelism each rank's target covers its own heads and the gradients reaching the (replicated)
indexer are averaged over TP: megatron's gradient exactly (the KL gradient is linear in the
target); the logged value is the mean of the per-rank KLs, which is >= megatron's value (it
all-reduces the head-summed probabilities first).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core.models.common.embeddings import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa as mcore_dsa
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import build_module

from ... import ops
from ...common.settings import warn_once
from .indexer import is_packed, packed_windows
from .layers import deterministic_for


class _ReduceGradOverGroup(torch.autograd.Function):
    """Identity forward; backward sums (``mean=False``) or averages the gradient over ``group``.

    Sum: a tensor every TP rank reads for its own heads (the KV latent). Mean: the indexer's
    outputs when each rank's loss sees its own heads (keeps the replicated indexer identical).
    (megatron's copy_to_tensor_model_parallel_region would drop the reduction of a
    non-contiguous gradient: it all-reduces a contiguous copy and returns the original.)"""

    @staticmethod
    def forward(ctx, x, group, mean):
        ctx.group, ctx.mean = group, mean
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return (grad / ctx.group.size() if ctx.mean else grad), None, None


def _to_rows(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """[s, b, ...] -> [b * s, ...] (batch-major); packed [t, ...] unchanged."""
    if packed:
        return t
    return t.transpose(0, 1).reshape(t.shape[0] * t.shape[1], *t.shape[2:])


class TopkCarrier:
    """Hands a layer's top-k rows to the following layers that share them (GLM-5
    ``indexer_types`` "shared": no indexer of their own, reuse the previous "full" layer's top-k).

    One instance is shared by the layers of a block through their spec params. The rows travel in
    forward order within one micro-batch; full-layer activation recompute and pipeline stages that
    split a full layer from its shared layers are not supported (checked at run time where
    possible)."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple] = {}

    def put(self, layer_number: int, rows, windows) -> None:
        self.rows[layer_number] = (rows, windows)

    def get(self, layer_number: int):
        source = max((n for n in self.rows if n < layer_number), default=None)
        if source is None:
            raise RuntimeError(
                f"DSA layer {layer_number} shares top-k indices but no earlier layer with an indexer ran in "
                "this forward pass (is it on another pipeline stage?)"
            )
        return self.rows[source]


class DSAttention(MegatronModule):
    """DeepSeek sparse attention core (see the module docstring). ``k_channels`` / ``v_channels``
    are accepted and unused (shapes come from the inputs). ``topk_carrier``: a
    :class:`TopkCarrier` shared by the layers of a block; a layer built without an indexer
    (``submodules.indexer=None``) reuses the top-k of the closest earlier layer through it."""

    def __init__(
        self,
        config,
        submodules,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: str = "p2p",
        pg_collection: Optional[ProcessGroupCollection] = None,
        backend: Optional[str] = None,
        topk_carrier: Optional[TopkCarrier] = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        self.topk_carrier = topk_carrier
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        if submodules.indexer is None:
            if topk_carrier is None:
                raise ValueError("a DSAttention without an indexer needs a topk_carrier to share top-k indices")
            if getattr(config, "recompute_granularity", None) == "full":
                raise NotImplementedError("shared top-k DSA layers do not support full activation recompute")
            self.indexer = None
        else:
            self.indexer = build_module(submodules.indexer, config=self.config, pg_collection=pg_collection)
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels if k_channels is not None else config.kv_channels)
        self.softmax_scale = softmax_scale
        # sparse-stage indexer loss inside the attention backward (absorbed path); False: the
        # standalone loss op in the forward (its value is logged there, at the cost of a second
        # gather of every selected kv row)
        self.fuse_indexer_loss = True

    # ------------------------------------------------------------------ helpers
    def _loss_enabled(self) -> bool:
        coeff = getattr(self.config, "dsa_indexer_loss_coeff", None) or 0.0
        return self.training and torch.is_grad_enabled() and coeff > 0

    def _apply_mask(self, rows, attention_mask, attn_mask_type, batch, seqlen, packed):
        """Drop selected keys an explicit (non-causal-only) boolean mask [b, 1, sq, sk] masks."""
        if attn_mask_type is not None or attention_mask is None or packed:
            if attn_mask_type not in (None, AttnMaskType.causal, AttnMaskType.padding_causal):
                raise NotImplementedError(f"DSAttention supports causal masks, got {attn_mask_type}")
            return rows
        mask = attention_mask.reshape(batch, seqlen, -1)  # True = masked
        base = (torch.arange(batch, device=rows.device) * seqlen).repeat_interleave(seqlen)[:, None]
        pos = (rows.long() - base).clamp_min(0).view(batch, seqlen, -1)
        hit = torch.gather(mask, -1, pos).reshape(rows.shape)
        return rows.masked_fill(hit, -1)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        x: Optional[torch.Tensor] = None,
        qr: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        w_vc: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("DSAttention does not support attention_bias")
        if x is None or qr is None:
            raise ValueError(
                "DSAttention needs the hidden states x and the query latent qr; megatron passes them "
                "when config.experimental_attention_variant == 'dsa'"
            )
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("dsa_plugins' Megatron DSAttention does not support context parallelism yet")
        if key.shape[0] != query.shape[0]:
            raise NotImplementedError(
                "DSAttention handles self-attention over the whole sequence (training, prefill); "
                f"got {query.shape[0]} query and {key.shape[0]} key positions (a KV cache?)"
            )
        packed = is_packed(packed_seq_params)
        absorbed = w_vc is not None
        if packed:
            seqlen, batch = query.shape[0], 1
        else:
            seqlen, batch = query.shape[0], query.shape[1]

        # indexer (inputs detached: its gradients come from the indexer loss only)
        if self.indexer is None:  # shared layer: the top-k of the closest earlier layer
            rows, (key_start, key_end) = self.topk_carrier.get(self.layer_number)
        else:
            index_q, index_k, weights, _ = self.indexer.project(x.detach(), qr.detach(), packed_seq_params)
            key_start, key_end = packed_windows(packed_seq_params, batch, seqlen, query.device)
            rows = self.indexer.select(index_q, index_k, weights, key_start, key_end)
            rows = self._apply_mask(rows, attention_mask, attn_mask_type, batch, seqlen, packed)
            if self.topk_carrier is not None:
                self.topk_carrier.put(self.layer_number, rows, (key_start, key_end))

        q = _to_rows(query, packed)  # [T, np, D]
        need_loss = self.indexer is not None and self._loss_enabled()
        fused_loss = None
        if need_loss and absorbed and self.fuse_indexer_loss and getattr(self.config, "dsa_indexer_use_sparse_loss", False):
            fused_loss = self._fused_indexer_loss(index_q, index_k, weights)
        with deterministic_for(self.config):  # megatron's deterministic_mode: the ops' deterministic backward
            if absorbed:
                kv = _to_rows(key, packed)  # [T, c + r]
                out = ops.sparse_mla(q, kv, rows, w_vc, self.softmax_scale, backend=self.backend,
                                     indexer_loss=fused_loss)
            else:
                k = _to_rows(key, packed)
                v = _to_rows(value, packed)
                out = self._per_head_attention(q, k, v, rows)

        if packed:
            output = out.reshape(out.shape[0], -1)
        else:
            output = out.reshape(batch, seqlen, -1).transpose(0, 1).contiguous()

        if need_loss and fused_loss is None:
            with deterministic_for(self.config):  # the standalone loss's backward too (d_index_k summed in order)
                loss = self._indexer_loss(index_q, index_k, weights, q, kv if absorbed else None, rows,
                                          key_start, key_end, query, key, batch, seqlen, absorbed, packed)
            mcore_dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(
                loss=loss, layer_number=self.layer_number, num_layers=self.config.num_layers
            )
            output = mcore_dsa.DSAIndexerLossAutoScaler.apply(output, loss)
        return output

    def _per_head_attention(self, q, k, v, rows):
        """Per-head K/V (megatron's unabsorbed MLA): one MQA call per head, kv = [v, k], q = [0, q]."""
        dv = v.shape[-1]
        outs = []
        for h in range(q.shape[1]):
            kv_h = torch.cat([v[:, h], k[:, h]], dim=-1)
            q_h = torch.cat([q.new_zeros(q.shape[0], 1, dv), q[:, h : h + 1]], dim=-1)
            outs.append(ops.sparse_attention(q_h, kv_h, rows, self.softmax_scale, dv=dv, backend=self.backend))
        return torch.cat(outs, dim=1)

    def _fused_indexer_loss(self, index_q, index_k, weights):
        """The sparse-stage loss computed inside the sparse attention's backward (no second gather
        of the kv rows). Its gradient enters with coeff * DSAIndexerLossAutoScaler's scale, as
        megatron's autoscaler gives it, and its value is logged from the backward."""
        coeff = float(self.config.dsa_indexer_loss_coeff)
        tp = self.pg_collection.tp
        if tp.size() > 1:
            index_q = _ReduceGradOverGroup.apply(index_q, tp, True)
            index_k = _ReduceGradOverGroup.apply(index_k, tp, True)
            weights = _ReduceGradOverGroup.apply(weights, tp, True)

        def weight():
            scale = mcore_dsa.DSAIndexerLossAutoScaler.main_loss_backward_scale
            return coeff if scale is None else scale * coeff

        def log(value):
            value = value.detach() * coeff
            if tp.size() > 1:  # mean over TP ranks (each saw its own heads)
                torch.distributed.all_reduce(value, group=tp)
                value = value / tp.size()
            mcore_dsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker(
                loss=value, layer_number=self.layer_number, num_layers=self.config.num_layers
            )

        return ops.FusedIndexerLoss(index_q, index_k, weights, weight=weight, on_value=log)

    def _indexer_loss(self, index_q, index_k, weights, q, kv, rows, key_start, key_end,
                      query, key, batch, seqlen, absorbed, packed):
        cfg = self.config
        coeff = float(cfg.dsa_indexer_loss_coeff)
        sparse = bool(getattr(cfg, "dsa_indexer_use_sparse_loss", False))
        tp = self.pg_collection.tp
        if not absorbed:
            # per-head K: megatron's own dense reference (O(s^2) memory, like megatron)
            if packed:
                raise NotImplementedError("the indexer loss with per-head K/V supports the bshd layout only")
            scores = self._dense_index_scores(index_q, index_k, weights, batch, seqlen)
            pos = (rows.long() - (torch.arange(batch, device=rows.device) * seqlen).repeat_interleave(seqlen)[:, None])
            # -1 only pads rows that selected every causal key, key 0 among them: mapping it to 0 is a no-op
            pos = torch.where(rows >= 0, pos, pos.new_zeros(()))
            return mcore_dsa.compute_dsa_indexer_loss(
                scores, pos.view(batch, seqlen, -1), query.detach(), key.detach(), self.softmax_scale,
                coeff, sparse, self.pg_collection,
            )
        if tp.size() > 1:
            index_q = _ReduceGradOverGroup.apply(index_q, tp, True)
            index_k = _ReduceGradOverGroup.apply(index_k, tp, True)
            weights = _ReduceGradOverGroup.apply(weights, tp, True)
        # attn_lse=None: the op renormalises over the same slots, which is the sparse attention's
        # normaliser in the sparse stage and the dense one in the warm-up (megatron's two targets)
        loss = ops.indexer_kl_loss(
            index_q, index_k, weights, q.detach(), kv.detach(), None, self.softmax_scale,
            topk_indices=rows if sparse else None, key_start=key_start, key_end=key_end,
            backend=self.backend,
        )
        loss = loss * coeff
        if tp.size() > 1:  # logged value: mean over TP ranks (each saw its own heads)
            value = loss.detach().clone()
            torch.distributed.all_reduce(value, group=tp)
            loss = loss + (value / tp.size() - loss.detach())
        return loss

    @staticmethod
    def _dense_index_scores(index_q, index_k, weights, batch, seqlen):
        q = index_q.view(batch, seqlen, index_q.shape[1], -1).float()
        k = index_k.view(batch, seqlen, -1).float()
        s = torch.einsum("bshd,btd->bsht", q, k).relu()
        s = (s * weights.view(batch, seqlen, -1, 1)).sum(dim=2)
        return s + torch.full((seqlen, seqlen), float("-inf"), device=s.device).triu(1)


class AbsorbedMLASelfAttention(MLASelfAttention):
    """Megatron's ``MLASelfAttention`` (same constructor, submodules and weights) whose training
    forward keeps the KV latent: the query is absorbed (q_nope @ W_kc), the core attention gets
    the latent [s, b, kv_lora_rank + rope] and W_vc, and no per-head K/V is materialised.

    Inference (``inference_context``), latent caching and ``mla_up_proj`` recompute fall back to
    megatron's forward (per-head K/V, which :class:`DSAttention` also accepts). The separate
    ``q_layernorm`` / ``kv_layernorm`` keep ``qr`` normalised for the indexer; checkpoints that hold
    them fused into ``linear_{q,kv}_up_proj.layer_norm_weight`` (Transformer Engine spec) load too.
    """

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None):
        """With Transformer Engine linears, name the q/kv norms as megatron's TE DSA spec does
        (fused into the up projections), so its distributed checkpoints load and vice versa."""
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        te = any(type(m).__name__.startswith("TE") for m in (self.linear_q_up_proj, self.linear_kv_up_proj))
        if te:
            from megatron.core.dist_checkpointing.utils import apply_prefix_mapping

            apply_prefix_mapping(sharded, {
                f"{prefix}q_layernorm.": f"{prefix}linear_q_up_proj.layer_norm_",
                f"{prefix}kv_layernorm.": f"{prefix}linear_kv_up_proj.layer_norm_",
            })
        return sharded

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for fused, split in (
            ("linear_q_up_proj.layer_norm_weight", "q_layernorm.weight"),
            ("linear_kv_up_proj.layer_norm_weight", "kv_layernorm.weight"),
        ):
            if prefix + fused in state_dict and prefix + split not in state_dict:
                state_dict[prefix + split] = state_dict.pop(prefix + fused)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        position_ids=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        fallback = (
            inference_context is not None
            or inference_params is not None
            or self.cache_mla_latents
            or self.recompute_up_proj
            or not isinstance(self.core_attention, DSAttention)
        )
        if self.training and (self.recompute_up_proj or self.checkpoint_core_attention):
            warn_once(
                "megatron.dsa.recompute",
                "dsa_plugins: selective recompute of 'mla_up_proj' falls back to megatron's per-head MLA path "
                "(slow) and 'core_attn' recompute is not applied to DSA (the sparse attention keeps only "
                "indices and the log-sum-exp; nothing large to recompute)",
            )
        if fallback:
            return super().forward(
                hidden_states, attention_mask, key_value_states=key_value_states,
                inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                rotary_pos_cos_sin=rotary_pos_cos_sin, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, position_ids=position_ids,
                sequence_len_offset=sequence_len_offset, inference_params=inference_params,
            )
        assert rotary_pos_emb is None and attention_bias is None, "MLA takes neither rotary_pos_emb nor attention_bias"
        query, latent, w_vc, q_compressed = self._absorbed_qkv(hidden_states, packed_seq_params)
        core_out = self.core_attention(
            query, latent, None, attention_mask, x=hidden_states, qr=q_compressed,
            attn_mask_type=self.attn_mask_type, packed_seq_params=packed_seq_params, w_vc=w_vc,
        )
        if is_packed(packed_seq_params):
            core_out = core_out.reshape(core_out.size(0), 1, -1)
        output, bias = self.linear_proj(core_out)
        return output, bias

    def _absorbed_qkv(self, hidden_states, packed_seq_params):
        cfg = self.config
        packed = is_packed(packed_seq_params)
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, cfg, packed_seq_params)
        if cfg.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(seq_len, packed_seq=packed), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(seq_len, packed_seq=packed)
        cu_q = cu_kv = None
        if packed:
            p = packed_seq_params
            cu_q = p.cu_seqlens_q_padded if p.cu_seqlens_q_padded is not None else p.cu_seqlens_q
            cu_kv = p.cu_seqlens_kv_padded if p.cu_seqlens_kv_padded is not None else p.cu_seqlens_kv
        sp = cfg.sequence_parallel and self.pg_collection.tp.size() > 1

        # query latent (normalised: the indexer's qr)
        if cfg.q_lora_rank is not None:
            q_compressed, _ = self.linear_q_down_proj(hidden_states)
            if q_compressed.size(-1) != cfg.q_lora_rank:  # column-parallel down projection
                q_compressed = gather_from_tensor_model_parallel_region(q_compressed)
                if cfg.sequence_parallel:
                        q_compressed = scatter_to_sequence_parallel_region(q_compressed)
            if packed:
                q_compressed = q_compressed.squeeze(1)
            q_compressed = self.q_layernorm(q_compressed)
            q, _ = self.linear_q_up_proj(q_compressed)
        else:
            q_compressed = hidden_states.squeeze(1) if packed else hidden_states
            q, _ = self.linear_q_proj(hidden_states)
            if packed:
                q = q.squeeze(1)

        # KV latent, full sequence (SP: gathered here instead of inside linear_kv_up_proj)
        # The norm runs on this rank's sequence shard under SP (its weight is marked
        # sequence-parallel: megatron all-reduces its gradient over TP), then the normalised
        # latent is gathered; every rank needs all of it for its own heads.
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        latent_dim = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        if kv_combined.size(-1) != latent_dim:  # column-parallel down projection: full sequence
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            if sp:
                kv_combined = scatter_to_sequence_parallel_region(kv_combined)
        if packed:
            kv_combined = kv_combined.squeeze(1)
        kv_compressed, k_pe = torch.split(kv_combined, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        kv_compressed = self.kv_layernorm(kv_compressed)
        if sp:
            both = torch.cat([kv_compressed, k_pe.to(kv_compressed.dtype)], dim=-1)
            both = gather_from_sequence_parallel_region(both, group=self.pg_collection.tp)
            kv_compressed, k_pe = torch.split(both, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)

        nh = self.num_attention_heads_per_partition
        q = q.view(*q.shape[:-1], nh, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)
        if not packed:
            freqs = freqs[: q.shape[0]]
        cp = self.pg_collection.cp
        q_pe = apply_rotary_pos_emb(q_pe, freqs, config=cfg, cu_seqlens=cu_q, mscale=mscale, cp_group=cp)
        k_pe = apply_rotary_pos_emb(k_pe.unsqueeze(-2), freqs, config=cfg, cu_seqlens=cu_kv, mscale=mscale, cp_group=cp)
        k_pe = k_pe.squeeze(-2)

        # absorb W_kc into the query; W_vc goes to the core attention
        w = self.linear_kv_up_proj.weight.view(nh, cfg.qk_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_kc, w_vc = w[:, : cfg.qk_head_dim], w[:, cfg.qk_head_dim :]
        q_abs = torch.einsum("...hd,hdc->...hc", q_nope, w_kc.to(q_nope.dtype))
        query = torch.cat([q_abs, q_pe], dim=-1).contiguous()
        latent = torch.cat([kv_compressed, k_pe.to(kv_compressed.dtype)], dim=-1).contiguous()
        if not sp and self.pg_collection.tp.size() > 1:
            # each rank reads the latent for its own heads: sum the latent's gradient over TP (what
            # linear_kv_up_proj's input does in megatron's unabsorbed path; under SP the gather's
            # reduce-scatter does it)
            latent = _ReduceGradOverGroup.apply(latent, self.pg_collection.tp, False)
        return query, latent, w_vc, q_compressed
