"""Lightning indexer for Megatron-core, a drop-in for megatron's ``DSAIndexer``.

Same constructor, same submodule names (``linear_wq_b``, ``linear_wk``, ``k_norm``,
``linear_weights_proj``), so checkpoints of megatron's indexer load unchanged. Differences:

- top-k goes through :func:`dsa_plugins.ops.indexer_topk` over packed rows with causal key windows
  (no ``[b, s, s]`` score matrix), also for packed (THD) sequences;
- the indexer RoPE follows the model instead of megatron 0.16's fixed choice:
  ``rope_layout`` "pe_first" (DeepSeek-V3.2 and GLM-5 reference: rotary dims first) or
  "nope_first" (megatron 0.16); ``rope_interleaved`` True (GLM-5, and megatron 0.16 under MLA) or
  False (DeepSeek-V3.2: half-split); ``hadamard`` applies V3.2's rotation to q and k (it preserves
  dot products; it matters only for fp8 scoring), and ``k_norm_eps`` (1e-6 in both models; megatron
  uses ``config.layernorm_epsilon``).

These four come from spec params (see ``dsa_plugins.megatron.get_dsa_layer_spec``) or, when not
given, from the config attributes ``dsa_indexer_rope_layout``, ``dsa_indexer_rope_interleaved``,
``dsa_indexer_hadamard``, ``dsa_indexer_k_norm_eps``.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding, apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from ... import ops
from .layers import hadamard_rotate, rope_config

ROPE_LAYOUTS = ("pe_first", "nope_first")


def is_packed(packed_seq_params: Optional[PackedSeqParams]) -> bool:
    return packed_seq_params is not None and packed_seq_params.qkv_format == "thd"


def packed_windows(packed_seq_params: Optional[PackedSeqParams], batch: int, seqlen: int, device):
    """Causal key windows ``(key_start, key_end)`` [T] int32 over the rows of the packed layout.

    bshd input is packed batch-major (row = b * seqlen + s); THD uses ``cu_seqlens_q`` (and
    ``cu_seqlens_q_padded``, whose padding rows are never keys)."""
    if is_packed(packed_seq_params):
        cu = packed_seq_params.cu_seqlens_q.to(device=device, dtype=torch.int32)
        cu_pad = packed_seq_params.cu_seqlens_q_padded
        if cu_pad is not None:
            cu_pad = cu_pad.to(device=device, dtype=torch.int32)
            if torch.equal(cu_pad, cu):
                cu_pad = None
        return ops.causal_key_windows(cu, cu_pad)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32) * seqlen
    return ops.causal_key_windows(cu)


class DSAIndexer(MegatronModule):
    """DSA lightning indexer (see the module docstring)."""

    def __init__(
        self,
        config,
        submodules,
        pg_collection: Optional[ProcessGroupCollection] = None,
        rope_layout: Optional[str] = None,
        rope_interleaved: Optional[bool] = None,
        hadamard: Optional[bool] = None,
        k_norm_eps: Optional[float] = None,
    ) -> None:
        super().__init__(config=config)
        cfg = self.config
        self.hidden_size = cfg.hidden_size
        self.qk_pos_emb_head_dim = cfg.qk_pos_emb_head_dim
        self.q_lora_rank = cfg.q_lora_rank if cfg.q_lora_rank is not None else cfg.hidden_size
        self.index_n_heads = cfg.dsa_indexer_n_heads
        self.index_head_dim = cfg.dsa_indexer_head_dim
        self.index_topk = cfg.dsa_indexer_topk
        self.softmax_scale = self.index_head_dim**-0.5

        self.rope_layout = rope_layout or getattr(cfg, "dsa_indexer_rope_layout", None) or "pe_first"
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"rope_layout must be one of {ROPE_LAYOUTS}, got {self.rope_layout!r}")
        if rope_interleaved is None:
            rope_interleaved = getattr(cfg, "dsa_indexer_rope_interleaved", None)
        self.rope_interleaved = True if rope_interleaved is None else bool(rope_interleaved)
        if hadamard is None:
            hadamard = getattr(cfg, "dsa_indexer_hadamard", None)
        self.hadamard = bool(hadamard)
        if k_norm_eps is None:
            k_norm_eps = getattr(cfg, "dsa_indexer_k_norm_eps", None)
        self.k_norm_eps = 1e-6 if k_norm_eps is None else float(k_norm_eps)
        self._rope_cfg = rope_config(cfg, self.rope_interleaved)

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection

        if cfg.rope_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                self.qk_pos_emb_head_dim,
                rotary_percent=cfg.rotary_percent,
                rotary_base=cfg.rotary_base,
                cp_group=pg_collection.cp,
            )
        elif cfg.rope_type == "yarn":
            self.rotary_pos_emb = YarnRotaryEmbedding(
                self.qk_pos_emb_head_dim,
                rotary_base=cfg.rotary_base,
                scaling_factor=cfg.rotary_scaling_factor,
                original_max_position_embeddings=cfg.original_max_position_embeddings,
                beta_fast=cfg.beta_fast,
                beta_slow=cfg.beta_slow,
                mscale=cfg.mscale,
                mscale_all_dim=cfg.mscale_all_dim,
                cp_group=pg_collection.cp,
            )
        else:
            raise ValueError(f"DSA indexer supports rope_type 'rope' and 'yarn', got {cfg.rope_type!r}")

        linear_kwargs = dict(
            config=cfg,
            init_method=cfg.init_method,
            bias=False,
            skip_bias_add=False,
            skip_weight_param_allocation=False,
            parallel_mode="duplicated",
        )
        self.linear_wq_b = build_module(
            submodules.linear_wq_b, self.q_lora_rank, self.index_n_heads * self.index_head_dim, **linear_kwargs
        )
        self.linear_wk = build_module(submodules.linear_wk, self.hidden_size, self.index_head_dim, **linear_kwargs)
        k_norm_config = copy.copy(cfg)
        k_norm_config.normalization = "LayerNorm"
        k_norm_config.sequence_parallel = False  # the indexer sees the gathered sequence
        self.k_norm = build_module(
            submodules.k_norm, config=k_norm_config, hidden_size=self.index_head_dim, eps=self.k_norm_eps
        )
        self.linear_weights_proj = build_module(
            submodules.linear_weights_proj, self.hidden_size, self.index_n_heads, **linear_kwargs
        )

    # ------------------------------------------------------------------ projections
    def _rotary(self, x: torch.Tensor, packed_seq_params):
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, None, x, self.config, packed_seq_params)
        packed = is_packed(packed_seq_params)
        if self.config.rope_type == "rope":
            return self.rotary_pos_emb(seq_len, packed_seq=packed), 1.0
        return self.rotary_pos_emb(seq_len, packed_seq=packed)

    def _apply_rope(self, t: torch.Tensor, freqs, mscale, cu_seqlens) -> torch.Tensor:
        r = self.qk_pos_emb_head_dim
        if self.rope_layout == "pe_first":
            pe, nope = t[..., :r], t[..., r:]
        else:
            nope, pe = t[..., : t.shape[-1] - r], t[..., t.shape[-1] - r :]
        if cu_seqlens is None:
            freqs = freqs[: t.shape[0]]
        pe = apply_rotary_pos_emb(
            pe, freqs, config=self._rope_cfg, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=self.pg_collection.cp
        )
        return torch.cat([pe, nope] if self.rope_layout == "pe_first" else [nope, pe], dim=-1)

    def project(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params: Optional[PackedSeqParams] = None):
        """Indexer queries, keys and head weights over packed rows.

        ``x`` [s, b, hidden] (or [t, 1, hidden] / [t, hidden] packed), ``qr`` [s, b, q_lora_rank]
        (normalised; [t, q_lora_rank] packed), both sequence-sharded under SP.
        Returns ``index_q`` [T, Hi, Di], ``index_k`` [T, Di], ``weights`` [T, Hi] fp32 with
        ``Hi^-0.5 * Di^-0.5`` folded in, and ``(batch, seqlen)`` of the layout (T = batch * seqlen,
        batch-major; for THD batch = 1)."""
        freqs, mscale = self._rotary(x, packed_seq_params)
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        packed = is_packed(packed_seq_params)
        if packed:
            x = x.reshape(x.shape[0], 1, x.shape[-1])
            qr = qr.reshape(qr.shape[0], 1, qr.shape[-1])
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
        else:
            cu = None
        seqlen, batch, _ = x.shape

        q, _ = self.linear_wq_b(qr)
        q = q.reshape(seqlen, batch, self.index_n_heads, self.index_head_dim)
        k, _ = self.linear_wk(x)
        k = self.k_norm(k).reshape(seqlen, batch, 1, self.index_head_dim)
        if packed:  # THD rope wants [t, h, d]
            q = self._apply_rope(q.squeeze(1), freqs, mscale, cu).unsqueeze(1)
            k = self._apply_rope(k.squeeze(1), freqs, mscale, cu).unsqueeze(1)
        else:
            q = self._apply_rope(q, freqs, mscale, None)
            k = self._apply_rope(k, freqs, mscale, None)
        if self.hadamard:
            q, k = hadamard_rotate(q), hadamard_rotate(k)
        weights, _ = self.linear_weights_proj(x)
        weights = weights.float() * (self.index_n_heads**-0.5 * self.softmax_scale)

        # [s, b, ...] -> [b * s, ...] (batch-major rows)
        index_q = q.transpose(0, 1).reshape(batch * seqlen, self.index_n_heads, self.index_head_dim)
        index_k = k.transpose(0, 1).reshape(batch * seqlen, self.index_head_dim)
        weights = weights.transpose(0, 1).reshape(batch * seqlen, self.index_n_heads)
        return index_q, index_k, weights, (batch, seqlen)

    # ------------------------------------------------------------------ selection
    def select(self, index_q, index_k, weights, key_start, key_end) -> torch.Tensor:
        """Top-k rows [T, topk] int32 (global rows into ``index_k``, -1 where fewer keys exist)."""
        with torch.no_grad():
            return ops.indexer_topk(
                index_q.detach(), index_k.detach(), weights.detach(), self.index_topk, key_start, key_end
            )

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        """Megatron-compatible: top-k key positions [b, s, topk] (int64, position within the
        sequence; -1 where fewer keys exist). Causal; ``mask`` (additive fp32 [b, s, s] or [s, s])
        is applied when given by dropping selected keys it masks."""
        index_q, index_k, weights, (batch, seqlen) = self.project(x, qr, packed_seq_params)
        start, end = packed_windows(packed_seq_params, batch, seqlen, index_q.device)
        rows = self.select(index_q, index_k, weights, start, end).long()
        if is_packed(packed_seq_params):
            return rows.unsqueeze(0)
        base = (torch.arange(batch, device=rows.device) * seqlen).repeat_interleave(seqlen).unsqueeze(-1)
        pos = torch.where(rows >= 0, rows - base, rows).view(batch, seqlen, -1)
        if mask is not None:
            full = mask.expand(batch, seqlen, seqlen) if mask.dim() == 2 else mask
            hit = torch.gather(full, -1, pos.clamp_min(0)) == float("-inf")
            pos = pos.masked_fill(hit, -1)
        return pos

    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        """Megatron-compatible dense path: ``(index_scores [b, s, s] fp32, topk [b, s, k])``.
        O(s^2) memory, for tests and debugging only."""
        if is_packed(packed_seq_params):
            raise NotImplementedError("forward_with_scores supports the bshd layout only")
        index_q, index_k, weights, (batch, seqlen) = self.project(x, qr, packed_seq_params)
        q = index_q.view(batch, seqlen, self.index_n_heads, -1).float()
        k = index_k.view(batch, seqlen, -1).float()
        scores = torch.einsum("bshd,btd->bsht", q, k).relu()
        scores = (scores * weights.view(batch, seqlen, -1, 1)).sum(dim=2)
        if mask is None:
            mask = torch.full((seqlen, seqlen), float("-inf"), device=scores.device).triu(1)
        scores = scores + mask
        # the canonical tie rule (lowest key wins, -0.0 == +0.0) as every other path; like megatron's
        # own, masked keys fill the row when it has fewer than k (callers scatter these indices)
        order = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices
        return scores, order[..., : min(self.index_topk, seqlen)]
