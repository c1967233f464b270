"""Sparse attention over a shared latent, and absorbed sparse MLA: public ops.

Two layouts, one implementation:
  batched  q [B, S, H, Dqk], kv [B, Skv, Dqk] (or [B, Skv, 1, Dqk]), indices [B, S, K] (or [B, S, 1, K])
  packed   q [T, H, Dqk],    kv [Tkv, Dqk] (or [Tkv, 1, Dqk]),      indices [T, K] (or [T, 1, K])
indices are int32 rows into kv of the same batch (packed: global rows); -1, any negative value and
any value >= Skv mean "no key" and are never read. K = kv, V = kv[..., :dv].

Returns out [.., H, dv] in q.dtype and, on request, lse [.., H] float32 (natural log, sink
excluded, +inf for a row with no valid key, whose output is 0 and whose gradients are 0).

The forward and backward are ``torch.library`` custom ops (``dsa_plugins::sparse_attention_fwd``
and ``dsa_plugins::sparse_attention_bwd``, in :mod:`.attention_custom_ops`) with fake
implementations, so torch.compile traces them; each picks the TileLang kernel or the torch
reference by the backend rules of :mod:`.backend`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common.settings import deterministic_enabled, resolve_backend
from ..common.validation import FLOAT_DTYPES, check_tensor
from ..reference.mla import project_values
from .attention_custom_ops import attention_backward, attention_forward, normalise_inputs
from .backend import autocast_floats, direct_call_ok
from .fused_indexer_loss import attention_with_indexer_loss


# ----------------------------------------------------------------------------- public ops


def sparse_attention(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    scale: float,
    sink: Tensor | None = None,
    dv: int | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    indexer_loss=None,
):
    """Sparse attention over a shared latent (layouts in the module docstring).

    scale: the model's softmax scale (explicit; no default). sink: per-head attention sink [H]
    (float32), or None. dv: value width (default Dqk). backend: "auto" | "tilelang" | "torch"
    (None: env DSA_PLUGINS_BACKEND, default "auto"). Differentiable in q, kv and sink.
    indexer_loss: a :class:`~dsa_plugins.ops.FusedIndexerLoss`; the sparse-stage indexer KL loss
    over these slots is then computed inside this op's backward (its value lands in the handle).
    Inside torch.autocast, float32 q and kv run in the autocast dtype (as SDPA does); sink stays float32.
    """
    q, kv = autocast_floats(q, kv)
    q4, kv3, idx3, sink, scale, dv, packed = normalise_inputs(q, kv, indices, scale, sink, dv)
    if indexer_loss is not None:
        if return_lse:
            raise ValueError("return_lse is not available together with indexer_loss")
        out = attention_with_indexer_loss(q4, kv3, idx3, sink, scale, dv, resolve_backend(backend), indexer_loss)
        return out.squeeze(0) if packed else out
    backend = resolve_backend(backend)
    if direct_call_ok(q4, kv3, idx3, sink) and not (torch.is_grad_enabled() and _any_requires_grad(q4, kv3, sink)):
        out, lse = attention_forward(q4, kv3, idx3, sink, scale, dv, backend)  # eager, no autograd: no dispatcher
    else:
        out, lse = torch.ops.dsa_plugins.sparse_attention_fwd(q4, kv3, idx3, sink, scale, dv, backend)
    if packed:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def _any_requires_grad(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def sparse_mla(
    q: Tensor, kv_latent: Tensor, indices: Tensor, w_vc: Tensor, scale: float, backend: str | None = None,
    sink: Tensor | None = None, indexer_loss=None,
) -> Tensor:
    """Absorbed sparse MLA: latent attention (dv = kv_lora_rank) then the W_vc up-projection.

    q [.., H, kv_lora_rank + rope] = cat(q_nope @ W_kc, q_pe); kv_latent [.., Skv, kv_lora_rank + rope];
    w_vc [H, v_head_dim, kv_lora_rank]; sink [H] fp32 or None (per-head attention sink, e.g. hy_v4).
    indexer_loss: a FusedIndexerLoss computed in the backward (see sparse_attention).
    Returns [.., H, v_head_dim] in q.dtype (the autocast dtype inside torch.autocast, see sparse_attention).
    """
    q, kv_latent, w_vc = autocast_floats(q, kv_latent, w_vc)
    check_tensor("w_vc", w_vc, ndim=3, dtypes=FLOAT_DTYPES)
    if not isinstance(q, Tensor) or q.dim() not in (3, 4):
        check_tensor("q", q, ndim=(3, 4))
    h = q.shape[-2]
    if w_vc.shape[0] != h or w_vc.shape[2] > q.shape[-1]:
        raise ValueError(
            f"w_vc must be [H={h}, v_head_dim, kv_lora_rank <= {q.shape[-1]}], got {tuple(w_vc.shape)}"
        )
    if w_vc.device != q.device:
        raise ValueError(f"w_vc must be on {q.device} (the device of q), got {w_vc.device}")
    latent = sparse_attention(q, kv_latent, indices, scale, sink=sink, dv=w_vc.shape[2], backend=backend,
                              indexer_loss=indexer_loss)
    return project_values(latent, w_vc).to(q.dtype)


# ----------------------------------------------------------------------------- head-chunked autograd


def _chunked_forward(ctx, q, kv, indices, sink, scale, dv, max_heads, backend):
    h = q.shape[2]
    step = h if max_heads is None else int(max_heads)
    if step < 1:
        raise ValueError(f"max_heads_per_kernel must be >= 1, got {max_heads}")
    outs, lses = [], []
    for h0 in range(0, h, step):
        hs = slice(h0, min(h0 + step, h))
        o, l = attention_forward(q[:, :, hs].contiguous(), kv, indices, None if sink is None else sink[hs].contiguous(), scale, dv, backend)
        outs.append(o)
        lses.append(l)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    lse = lses[0] if len(lses) == 1 else torch.cat(lses, dim=2)
    ctx.save_for_backward(q, kv, indices, sink, out, lse)
    ctx.scale, ctx.dv, ctx.step, ctx.backend = scale, dv, step, backend
    ctx.deterministic = deterministic_enabled()
    return out


def _chunked_backward(ctx, dout):
    q, kv, indices, sink, out, lse = ctx.saved_tensors
    h = q.shape[2]
    dout = dout.contiguous()
    dq = torch.empty_like(q)
    dkv = None
    dsink = None if sink is None else torch.empty_like(sink)
    # one chunk: dkv comes back in kv's dtype; several add their fp32 sums, cast at the end
    one = ctx.step >= h
    for h0 in range(0, h, ctx.step):
        hs = slice(h0, min(h0 + ctx.step, h))
        dq_c, dkv_c, dsink_c = attention_backward(
            q[:, :, hs].contiguous(), kv, indices, None if sink is None else sink[hs].contiguous(),
            out[:, :, hs].contiguous(), lse[:, :, hs].contiguous(), dout[:, :, hs].contiguous(),
            ctx.scale, ctx.dv, ctx.backend, ctx.deterministic, dkv_dtype=kv.dtype if one else None,
        )
        dq[:, :, hs] = dq_c
        dkv = dkv_c if dkv is None else dkv.add_(dkv_c)  # fp32 accumulation across head chunks
        if dsink is not None:
            dsink[hs] = dsink_c
    return dq, dkv.to(kv.dtype), dsink


def _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale):
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    q, kv, idx, sink, scale, dv, _ = normalise_inputs(q, kv, topk_idxs, scale, attn_sink, None)
    return q, kv, idx, sink, scale, dv


def _v4_backward(ctx, dout):
    """_chunked_backward for the V4 functions, its gradients in the shapes the caller passed (packed q [T, H, D],
    kv [B, Skv, 1, D] and the like)."""
    q_shape, kv_shape = ctx.shapes
    q_in = ctx.saved_tensors[0]
    dq, dkv, dsink = _chunked_backward(ctx, dout.reshape(q_in.shape))
    return dq.view(q_shape), dkv.view(kv_shape), dsink


class DeepSeekV4SparseAttention(torch.autograd.Function):
    """``apply(q [B,S,H,D] bf16, kv [B,Skv,D], attn_sink [H] fp32 | None, topk_idxs [B,S,k] int32,
    sm_scale=None) -> [B,S,H,D]`` (Dqk = Dv = D; sm_scale defaults to D**-0.5, DeepSeek-V4's scale)."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, topk_idxs, sm_scale=None):
        q_, kv_, idx, sink, scale, dv = _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale)
        ctx.shapes = q.shape, kv.shape
        return _chunked_forward(ctx, q_, kv_, idx, sink, scale, dv, None, resolve_backend(None)).view(q.shape)

    @staticmethod
    def backward(ctx, dout):
        dq, dkv, dsink = _v4_backward(ctx, dout)
        return dq, dkv, dsink, None, None


class DeepSeekV4SparseAttentionHeadChunked(torch.autograd.Function):
    """As DeepSeekV4SparseAttention, running head groups of at most ``max_heads_per_kernel`` and
    accumulating the shared dKV in float32 across groups: ``apply(q, kv, attn_sink, topk_idxs,
    max_heads_per_kernel, sm_scale=None)``."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, topk_idxs, max_heads_per_kernel, sm_scale=None):
        q_, kv_, idx, sink, scale, dv = _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale)
        ctx.shapes = q.shape, kv.shape
        out = _chunked_forward(ctx, q_, kv_, idx, sink, scale, dv, max_heads_per_kernel, resolve_backend(None))
        return out.view(q.shape)

    @staticmethod
    def backward(ctx, dout):
        dq, dkv, dsink = _v4_backward(ctx, dout)
        return dq, dkv, dsink, None, None, None


def sparse_attn_tilelang(q, kv, attn_sink, topk_idxs, sm_scale=None) -> Tensor:
    """DeepSeek-V4 sparse attention (NeMo AutoModel name): q [B,S,H,D] bf16, kv [B,Skv,D] bf16,
    attn_sink [H] fp32 (or None), topk_idxs [B,S,k] int32 (-1 = none); returns [B,S,H,D].
    sm_scale defaults to D**-0.5."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return sparse_attention(q, kv, topk_idxs, scale, sink=attn_sink)


def sparse_attn_tilelang_head_chunked(q, kv, attn_sink, topk_idxs, max_heads_per_kernel, sm_scale=None) -> Tensor:
    """sparse_attn_tilelang in head groups of at most ``max_heads_per_kernel`` (bounded workspace);
    dKV accumulated in float32 across groups."""
    return DeepSeekV4SparseAttentionHeadChunked.apply(q, kv, attn_sink, topk_idxs, max_heads_per_kernel, sm_scale)


def sparse_attention_head_chunked(
    q, kv, indices, scale, max_heads_per_kernel: int, sink=None, dv=None, backend: str | None = None
) -> Tensor:
    """sparse_attention (batched layout) in head groups of at most ``max_heads_per_kernel``."""
    q_, kv_, idx, sink_, scale_, dv_, packed = normalise_inputs(q, kv, indices, scale, sink, dv)
    out = _HeadChunked.apply(q_, kv_, idx, sink_, scale_, dv_, max_heads_per_kernel, resolve_backend(backend))
    return out.squeeze(0) if packed else out


class _HeadChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, sink, scale, dv, max_heads, backend):
        return _chunked_forward(ctx, q, kv, indices, sink, scale, dv, max_heads, backend)

    @staticmethod
    def backward(ctx, dout):
        dq, dkv, dsink = _chunked_backward(ctx, dout)
        return dq, dkv, None, dsink, None, None, None, None


def tilelang_sparse_attention(q, kv_latent, topk_indices, w_vc, softmax_scale: float) -> Tensor:
    """Absorbed sparse MLA on packed tokens (NeMo AutoModel name).

    q [T, H, kv_lora_rank + rope] bf16; kv_latent [T, 1, kv_lora_rank + rope] (or [T, D]);
    topk_indices [T, 1, k] (or [T, k]) int32 global rows, -1 = none; w_vc [H, v_head_dim, kv_lora_rank];
    softmax_scale: the model's (mscale**2 / sqrt(qk_head_dim)). Returns [T, H, v_head_dim].
    """
    return sparse_mla(q, kv_latent, topk_indices, w_vc, softmax_scale)
