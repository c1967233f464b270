"""Sparse attention over a shared latent, and absorbed sparse MLA: public ops.

Two layouts, one implementation:
  batched  q [B, S, H, Dqk], kv [B, Skv, Dqk] (or [B, Skv, 1, Dqk]), indices [B, S, K] (or [B, S, 1, K])
  packed   q [T, H, Dqk],    kv [Tkv, Dqk] (or [Tkv, 1, Dqk]),      indices [T, K] (or [T, 1, K])
indices are int32 rows into kv of the same batch (packed: global rows); -1, any negative value and
any value >= Skv mean "no key" and are never read. K = kv, V = kv[..., :dv].

Returns out [.., H, dv] in q.dtype and, on request, lse [.., H] float32 (natural log, sink
excluded, +inf for a row with no valid key, whose output is 0 and whose gradients are 0).

The forward and backward are ``torch.library`` custom ops (``dsa_plugins::sparse_attention_fwd``
and ``dsa_plugins::sparse_attention_bwd``) with fake implementations, so torch.compile traces
them; each picks the TileLang kernel or the torch reference by the backend rules of ``backend.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._config import check_indices_enabled, deterministic_enabled, resolve_backend
from .._indices import as_int32
from .._validation import FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_scale, check_tensor
from ..kernels import load_kernel
from ..reference.mla import project_values
from ..reference.sparse_attention import sparse_attention_backward, sparse_attention_forward
from .backend import choose_kernel, kernel_shape_reason


# ----------------------------------------------------------------------------- implementation


def _shape_reason(kernel: str, q: Tensor, dv: int, sink: Optional[Tensor]) -> str | None:
    return kernel_shape_reason(kernel, num_heads=q.shape[2], dqk=q.shape[3], dv=dv, has_sink=sink is not None,
                               dtype=q.dtype)


# The kernels address tensors with int32 offsets: longer inputs run in query chunks below this.
_MAX_KERNEL_ELEMENTS = 2**31 - 1


def _query_chunks(q: Tensor, indices: Tensor, dv: int) -> list[tuple[int, int]]:
    """Ranges of the query axis whose q / out / indices slices each stay under 2**31 elements
    (one range, the whole axis, for every realistic batch; 64K+ tokens x 64 heads x 576 need more)."""
    b, s, h, d = q.shape
    per_query = b * max(h * max(d, dv), indices.shape[-1] + 128)  # + the kernel's K padding
    step = max(1, _MAX_KERNEL_ELEMENTS // per_query)
    return [(a, min(a + step, s)) for a in range(0, s, step)]


def _trivial(q, kv) -> bool:
    """No query or no key: nothing for a kernel to do (and a grid of size 0 is not launched)."""
    return q.numel() == 0 or kv.shape[1] == 0


def _forward_impl(q, kv, indices, sink, scale: float, dv: int, backend: str):
    if _trivial(q, kv):
        return sparse_attention_forward(q, kv, indices, scale, sink, dv)
    if choose_kernel(backend, "sparse_attention_fwd", (q, kv), _shape_reason("sparse_attention_fwd", q, dv, sink)):
        kernel = load_kernel("sparse_attention_fwd")
        parts = [kernel(q[:, a:b].contiguous(), kv, indices[:, a:b].contiguous(), scale, sink, dv)
                 for a, b in _query_chunks(q, indices, dv)]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    return sparse_attention_forward(q, kv, indices, scale, sink, dv)


def _backward_impl(q, kv, indices, sink, out, lse, dout, scale: float, dv: int, backend: str, deterministic: bool,
                   return_probs: bool = False):
    """(dq in q.dtype, dkv in float32 (float64 for float64 inputs), dsink or None), plus with
    return_probs the head sum of P per slot, probs [B, S, K] in the accumulation dtype."""
    if _trivial(q, kv):
        return sparse_attention_backward(q, kv, indices, out, lse, dout, scale, sink, dv, return_probs)
    if choose_kernel(backend, "sparse_attention_bwd", (q, kv), _shape_reason("sparse_attention_bwd", q, dv, sink)):
        kernel = load_kernel("sparse_attention_bwd")
        dq, dkv, dsink, probs = [], None, None, []
        for a, b in _query_chunks(q, indices, dv):
            sl = slice(a, b)
            res = kernel(
                q[:, sl].contiguous(), kv, indices[:, sl].contiguous(), out[:, sl].contiguous(),
                lse[:, sl].contiguous(), dout[:, sl].contiguous(), scale, sink, dv, deterministic=deterministic,
                **({"return_probs": True} if return_probs else {}),
            )
            dq_c, dkv_c, dsink_c = res[:3]
            dq.append(dq_c)
            probs.append(res[3] if return_probs else None)
            dkv = dkv_c if dkv is None else dkv.add_(dkv_c)  # fp32, fixed order: deterministic stays so
            dsink = dsink_c if dsink is None or dsink_c is None else dsink.add_(dsink_c)
        res = (dq[0] if len(dq) == 1 else torch.cat(dq, dim=1)), dkv, dsink
        if return_probs:
            res += (probs[0] if len(probs) == 1 else torch.cat(probs, dim=1),)
        return res
    return sparse_attention_backward(q, kv, indices, out, lse, dout.contiguous(), scale, sink, dv, return_probs)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("dsa_plugins::sparse_attention_fwd", mutates_args=())
def _sparse_attention_fwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Optional[Tensor], scale: float, dv: int, backend: str
) -> tuple[Tensor, Tensor]:
    out, lse = _forward_impl(q, kv, indices, sink, scale, dv, backend)
    return out, lse


@_sparse_attention_fwd_op.register_fake
def _(q, kv, indices, sink, scale, dv, backend):
    b, s, h, _ = q.shape
    return q.new_empty(b, s, h, dv), q.new_empty(b, s, h, dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("dsa_plugins::sparse_attention_bwd", mutates_args=())
def _sparse_attention_bwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Optional[Tensor], out: Tensor, lse: Tensor, dout: Tensor,
    scale: float, dv: int, backend: str, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dkv, dsink = _backward_impl(q, kv, indices, sink, out, lse, dout, scale, dv, backend, deterministic)
    if dsink is None:  # custom ops return tensors only
        dsink = q.new_zeros(0, dtype=_lse_dtype(q.dtype))
    return dq, dkv, dsink


@_sparse_attention_bwd_op.register_fake
def _(q, kv, indices, sink, out, lse, dout, scale, dv, backend, deterministic):
    dsink_shape = (0,) if sink is None else tuple(sink.shape)
    acc = _lse_dtype(q.dtype)
    return torch.empty_like(q), kv.new_empty(kv.shape, dtype=acc), q.new_empty(dsink_shape, dtype=acc)


def _setup_context(ctx, inputs, output):
    q, kv, indices, sink, scale, dv, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, sink, out, lse)
    ctx.scale, ctx.dv, ctx.backend = scale, dv, backend
    ctx.deterministic = deterministic_enabled()
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, kv, indices, sink, out, lse = ctx.saved_tensors
    dq, dkv, dsink = torch.ops.dsa_plugins.sparse_attention_bwd(
        q, kv, indices, sink, out, lse, dout.contiguous(), ctx.scale, ctx.dv, ctx.backend, ctx.deterministic
    )
    return dq, dkv.to(kv.dtype), None, (None if sink is None else dsink.to(sink.dtype)), None, None, None


_sparse_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- validation


def _normalise(q, kv, indices, scale, sink, dv):
    """Validate and bring inputs to the batched layout. Returns (q, kv, indices, sink, scale, dv, packed)."""
    check_tensor("q", q, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    packed = q.dim() == 3
    device = q.device
    if packed:
        check_tensor("kv", kv, ndim=(2, 3), dtypes=FLOAT_DTYPES, device=device)
        check_tensor("indices", indices, ndim=(2, 3), dtypes=INDEX_DTYPES, device=device)
        if kv.dim() == 3:
            check_tensor("kv", kv, shape={1: 1})
            kv = kv.squeeze(1)
        if indices.dim() == 3:
            check_tensor("indices", indices, shape={1: 1})
            indices = indices.squeeze(1)
        q, kv, indices = q.unsqueeze(0), kv.unsqueeze(0), indices.unsqueeze(0)
    else:
        check_tensor("kv", kv, ndim=(3, 4), dtypes=FLOAT_DTYPES, device=device)
        check_tensor("indices", indices, ndim=(3, 4), dtypes=INDEX_DTYPES, device=device)
        if kv.dim() == 4:
            check_tensor("kv", kv, shape={2: 1})
            kv = kv.squeeze(2)
        if indices.dim() == 4:
            check_tensor("indices", indices, shape={2: 1})
            indices = indices.squeeze(2)
    b, s, h, d = q.shape
    what = "packed [T, H, D] q" if packed else "batched [B, S, H, D] q"
    if kv.dtype != q.dtype:
        raise ValueError(f"kv must have the dtype of q ({q.dtype}), got {kv.dtype}")
    if kv.shape[0] != b or kv.shape[2] != d:
        raise ValueError(f"kv must be [{'Tkv' if packed else f'{b}, Skv'}, {d}] for {what} of shape {tuple(q.shape[packed:])}, got {tuple(kv.shape[packed:])}")
    if indices.shape[0] != b or indices.shape[1] != s:
        raise ValueError(f"indices must be [{'' if packed else f'{b}, '}{s}, K] for {what} of shape {tuple(q.shape[packed:])}, got {tuple(indices.shape[packed:])}")
    if h == 0 or d == 0:
        raise ValueError(f"q must have at least one head and one feature, got shape {tuple(q.shape)}")
    scale = check_scale(scale)
    dv = d if dv is None else int(dv)
    if not 1 <= dv <= d:
        raise ValueError(f"dv must be in [1, {d}] (the value width is a prefix of kv), got {dv}")
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=FLOAT_DTYPES, device=device, shape={0: h})
        sink = sink.to(_lse_dtype(q.dtype))
    if check_indices_enabled():
        check_index_range("indices", indices, kv.shape[1])
    indices = as_int32(indices, kv.shape[1])
    if indices.shape[-1] == 0:  # no slot at all: one "no key" slot gives the empty-row result
        indices = indices.new_full((b, s, 1), -1)
    return q.contiguous(), kv.contiguous(), indices.contiguous(), sink, scale, dv, packed


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
    """
    q4, kv3, idx3, sink, scale, dv, packed = _normalise(q, kv, indices, scale, sink, dv)
    if indexer_loss is not None:
        if return_lse:
            raise ValueError("return_lse is not available together with indexer_loss")
        from .fused_indexer_loss import attention_with_indexer_loss

        out = attention_with_indexer_loss(q4, kv3, idx3, sink, scale, dv, resolve_backend(backend), indexer_loss)
        return out.squeeze(0) if packed else out
    out, lse = torch.ops.dsa_plugins.sparse_attention_fwd(q4, kv3, idx3, sink, scale, dv, resolve_backend(backend))
    if packed:
        out, lse = out.squeeze(0), lse.squeeze(0)
    return (out, lse) if return_lse else out


def sparse_mla(
    q: Tensor, kv_latent: Tensor, indices: Tensor, w_vc: Tensor, scale: float, backend: str | None = None,
    sink: Tensor | None = None, indexer_loss=None,
) -> Tensor:
    """Absorbed sparse MLA: latent attention (dv = kv_lora_rank) then the W_vc up-projection.

    q [.., H, kv_lora_rank + rope] = cat(q_nope @ W_kc, q_pe); kv_latent [.., Skv, kv_lora_rank + rope];
    w_vc [H, v_head_dim, kv_lora_rank]; sink [H] fp32 or None (per-head attention sink, e.g. hy_v4).
    indexer_loss: a FusedIndexerLoss computed in the backward (see sparse_attention).
    Returns [.., H, v_head_dim] in q.dtype.
    """
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
        o, l = _forward_impl(q[:, :, hs].contiguous(), kv, indices, None if sink is None else sink[hs].contiguous(), scale, dv, backend)
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
    for h0 in range(0, h, ctx.step):
        hs = slice(h0, min(h0 + ctx.step, h))
        dq_c, dkv_c, dsink_c = _backward_impl(
            q[:, :, hs].contiguous(), kv, indices, None if sink is None else sink[hs].contiguous(),
            out[:, :, hs].contiguous(), lse[:, :, hs].contiguous(), dout[:, :, hs].contiguous(),
            ctx.scale, ctx.dv, ctx.backend, ctx.deterministic,
        )
        dq[:, :, hs] = dq_c
        dkv = dkv_c if dkv is None else dkv.add_(dkv_c)  # fp32 accumulation across head chunks
        if dsink is not None:
            dsink[hs] = dsink_c
    return dq, dkv.to(kv.dtype), dsink


def _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale):
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    q, kv, idx, sink, scale, dv, _ = _normalise(q, kv, topk_idxs, scale, attn_sink, None)
    return q, kv, idx, sink, scale, dv


class DeepSeekV4SparseAttention(torch.autograd.Function):
    """``apply(q [B,S,H,D] bf16, kv [B,Skv,D], attn_sink [H] fp32 | None, topk_idxs [B,S,k] int32,
    sm_scale=None) -> [B,S,H,D]`` (Dqk = Dv = D; sm_scale defaults to D**-0.5, DeepSeek-V4's scale)."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, topk_idxs, sm_scale=None):
        q_, kv_, idx, sink, scale, dv = _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale)
        return _chunked_forward(ctx, q_, kv_, idx, sink, scale, dv, None, resolve_backend(None))

    @staticmethod
    def backward(ctx, dout):
        dq, dkv, dsink = _chunked_backward(ctx, dout)
        return dq, dkv, dsink, None, None


class DeepSeekV4SparseAttentionHeadChunked(torch.autograd.Function):
    """As DeepSeekV4SparseAttention, running head groups of at most ``max_heads_per_kernel`` and
    accumulating the shared dKV in float32 across groups: ``apply(q, kv, attn_sink, topk_idxs,
    max_heads_per_kernel, sm_scale=None)``."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, topk_idxs, max_heads_per_kernel, sm_scale=None):
        q_, kv_, idx, sink, scale, dv = _v4_inputs(q, kv, attn_sink, topk_idxs, sm_scale)
        return _chunked_forward(ctx, q_, kv_, idx, sink, scale, dv, max_heads_per_kernel, resolve_backend(None))

    @staticmethod
    def backward(ctx, dout):
        dq, dkv, dsink = _chunked_backward(ctx, dout)
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
    q_, kv_, idx, sink_, scale_, dv_, packed = _normalise(q, kv, indices, scale, sink, dv)
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
