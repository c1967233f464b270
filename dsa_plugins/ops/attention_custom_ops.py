"""Sparse attention's engine room: input normalisation, the kernel-or-reference choice with query
chunking, and the ``torch.library`` custom ops ``dsa_plugins::sparse_attention_fwd`` /
``dsa_plugins::sparse_attention_bwd`` (fake implementations for torch.compile, autograd).

Both public modules build on it: :mod:`.sparse_attention` (the ops users call) and
:mod:`.fused_indexer_loss` (the backward that also runs the indexer loss). Layouts and conventions
are documented in :mod:`.sparse_attention`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..common.indices import as_int32
from ..common.settings import check_indices_enabled, deterministic_enabled
from ..common.validation import FLOAT_DTYPES, INDEX_DTYPES, check_index_range, check_scale, check_tensor
from ..kernels import load_kernel
from ..reference.sparse_attention import sparse_attention_backward, sparse_attention_forward
from .backend import choose_kernel, kernel_shape_reason


# ----------------------------------------------------------------------------- kernel or reference


def _shape_reason(kernel: str, q: Tensor, dv: int, sink: Optional[Tensor]) -> str | None:
    return kernel_shape_reason(kernel, num_heads=q.shape[2], dqk=q.shape[3], dv=dv, has_sink=sink is not None,
                               dtype=q.dtype)


# Inputs longer than this run in chunks below it (q / out / indices for both kernels, kv for the backward; the
# forward's kv gathers are addressed in 64 bits, so it takes any cache whole).
_MAX_KERNEL_ELEMENTS = 2**31 - 1
# ... and the forward launches one CTA row per query on the grid's y axis, at most 65535 long.
_MAX_GRID_ROWS = 65535


def _query_elements(q: Tensor, indices: Tensor, dv: int) -> int:
    """Elements of the largest of the q / out / indices slices one query of one batch entry takes."""
    _, _, h, d = q.shape
    return max(h * max(d, dv), indices.shape[-1] + 128)  # + the kernel's K padding


def _query_step(q: Tensor, indices: Tensor, dv: int, batch: int) -> int:
    """Queries per chunk whose q / out / indices slices (``batch`` entries wide) stay under 2**31
    elements and whose grid rows stay under 65535."""
    return min(max(1, _MAX_KERNEL_ELEMENTS // (batch * _query_elements(q, indices, dv))), _MAX_GRID_ROWS)


def _batch_chunks(kv: Tensor) -> list[tuple[int, int]]:
    """Ranges of the batch axis whose kv slice stays under 2**31 elements (one range, the whole
    batch, unless the caches are long and many: B 32 x 128K tokens x 576 needs two)."""
    b, t, d = kv.shape
    step = max(1, _MAX_KERNEL_ELEMENTS // max(1, t * d))
    return [(a, min(a + step, b)) for a in range(0, b, step)]


def _kernel_chunks(q: Tensor, kv: Tensor, indices: Tensor, dv: int,
                   whole_kv: bool = False) -> list[tuple[int, int, int, int]]:
    """(b0, b1, s0, s1) blocks of the (batch, query) axes that each kernel launch takes.

    One block, the whole input, for every realistic shape. Long caches split the batch
    (:func:`_batch_chunks`) unless ``whole_kv``; a batch whose q / out / indices pass the bound runs in blocks of
    whole entries (a generation step of tens of thousands of sequences), and long inputs (64K+ tokens x 64 heads x
    576) split the queries one batch entry at a time. Every block is either whole query rows or a single entry, so
    its slice of a contiguous [B, S, ...] tensor is contiguous: the kernels write views of one output buffer
    and nothing is concatenated (a concatenation holds the output twice)."""
    s = q.shape[1]
    # whole entries per block: their q / out / indices under the bound, the batch (the grid's z axis) under 65536
    entries = min(_MAX_KERNEL_ELEMENTS // (s * _query_elements(q, indices, dv)), _MAX_GRID_ROWS) if s else 1
    blocks = []
    for b0, b1 in [(0, kv.shape[0])] if whole_kv else _batch_chunks(kv):
        if entries >= 1 and s <= _MAX_GRID_ROWS:
            blocks += [(a, min(a + entries, b1), 0, s) for a in range(b0, b1, entries)]
            continue
        step = _query_step(q, indices, dv, 1)
        blocks += [(b, b + 1, a, min(a + step, s)) for b in range(b0, b1) for a in range(0, s, step)]
    return blocks


def _trivial(q, kv) -> bool:
    """No query or no key: nothing for a kernel to do (and a grid of size 0 is not launched)."""
    return q.numel() == 0 or kv.shape[1] == 0


def attention_forward(q, kv, indices, sink, scale: float, dv: int, backend: str):
    if _trivial(q, kv):
        return sparse_attention_forward(q, kv, indices, scale, sink, dv)
    if choose_kernel(backend, "sparse_attention_fwd", (q, kv), _shape_reason("sparse_attention_fwd", q, dv, sink)):
        kernel = load_kernel("sparse_attention_fwd")
        b, s, h, _ = q.shape
        out = q.new_empty(b, s, h, dv)
        lse = q.new_empty(b, s, h, dtype=lse_dtype(q.dtype))  # float32 for the kernels' dtypes
        # the forward's programs address kv in 64 bits (TileLang computes every global offset in int64; the
        # compile test holds it): a generation step over B 32 x 128K-token caches is one launch, not one
        # latency-bound launch per batch chunk (H200, GLM-5 dims: 45.6 + 41.4 us -> one launch of 45-48 us)
        blocks = _kernel_chunks(q, kv, indices, dv, whole_kv=True)
        if len(blocks) == 1:  # the whole input (every realistic shape): no views to make
            kernel(q, kv, indices, scale, sink, dv, out=out, lse=lse, decode=s == 1)
            return out, lse
        for b0, b1, s0, s1 in blocks:
            blk = (slice(b0, b1), slice(s0, s1))
            # generation steps are the whole input's one-query rows, never a one-row tail block of a long one
            kernel(q[blk], kv[b0:b1], indices[blk], scale, sink, dv, out=out[blk], lse=lse[blk], decode=s == 1)
        return out, lse
    return sparse_attention_forward(q, kv, indices, scale, sink, dv)


def attention_backward(q, kv, indices, sink, out, lse, dout, scale: float, dv: int, backend: str, deterministic: bool,
                   return_probs: bool = False, dkv_dtype: Optional[torch.dtype] = None):
    """(dq in q.dtype, dkv in ``dkv_dtype`` (default: float32, float64 for float64 inputs: the sums; kv.dtype
    for a gradient to hand back, cast by the kernel in the pass it makes over dkv anyway), dsink or None), plus
    with return_probs the head sum of P per slot, probs [B, S, K] in the accumulation dtype."""
    acc = lse_dtype(q.dtype)  # float32 for the kernels' dtypes
    dkv_dtype = acc if dkv_dtype is None else dkv_dtype
    if not _trivial(q, kv) and choose_kernel(backend, "sparse_attention_bwd", (q, kv),
                                             _shape_reason("sparse_attention_bwd", q, dv, sink)):
        kernel = load_kernel("sparse_attention_bwd")
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        blocks = _kernel_chunks(q, kv, indices, dv)
        # one block (every realistic shape): the kernel's own dkv, returned in dkv_dtype. Several: one fp32
        # buffer, each block adds its part (query blocks of one cache accumulate into it in a fixed order,
        # so the deterministic mode stays bitwise reproducible), cast at the end
        dkv = None if len(blocks) == 1 else torch.zeros(kv.shape, dtype=acc, device=kv.device)
        probs = q.new_empty(*indices.shape, dtype=acc) if return_probs else None
        dsink = None
        for b0, b1, s0, s1 in blocks:
            blk = (slice(b0, b1), slice(s0, s1))
            res = kernel(
                q[blk], kv[b0:b1], indices[blk], out[blk], lse[blk], dout[blk], scale, sink, dv,
                deterministic=deterministic, dq=dq[blk],
                **({"dkv": dkv[b0:b1]} if dkv is not None else {"dkv_dtype": dkv_dtype}),
                **({"return_probs": True} if return_probs else {}),
            )
            dsink = res[2] if dsink is None or res[2] is None else dsink.add_(res[2])
            if return_probs:
                probs[blk].copy_(res[3])
        dkv = res[1] if dkv is None else dkv.to(dkv_dtype)
        return (dq, dkv, dsink) + ((probs,) if return_probs else ())
    res = sparse_attention_backward(q, kv, indices, out, lse, dout.contiguous(), scale, sink, dv, return_probs)
    return (res[0], res[1].to(dkv_dtype)) + res[2:]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- custom ops


@torch.library.custom_op("dsa_plugins::sparse_attention_fwd", mutates_args=())
def _sparse_attention_fwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Optional[Tensor], scale: float, dv: int, backend: str
) -> tuple[Tensor, Tensor]:
    out, lse = attention_forward(q, kv, indices, sink, scale, dv, backend)
    return out, lse


@_sparse_attention_fwd_op.register_fake
def _(q, kv, indices, sink, scale, dv, backend):
    b, s, h, _ = q.shape
    return q.new_empty(b, s, h, dv), q.new_empty(b, s, h, dtype=lse_dtype(q.dtype))


@torch.library.custom_op("dsa_plugins::sparse_attention_bwd", mutates_args=())
def _sparse_attention_bwd_op(
    q: Tensor, kv: Tensor, indices: Tensor, sink: Optional[Tensor], out: Tensor, lse: Tensor, dout: Tensor,
    scale: float, dv: int, backend: str, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dkv, dsink = attention_backward(q, kv, indices, sink, out, lse, dout, scale, dv, backend, deterministic,
                                        dkv_dtype=kv.dtype)
    if dsink is None:  # custom ops return tensors only
        dsink = q.new_zeros(0, dtype=lse_dtype(q.dtype))
    return dq, dkv, dsink


@_sparse_attention_bwd_op.register_fake
def _(q, kv, indices, sink, out, lse, dout, scale, dv, backend, deterministic):
    dsink_shape = (0,) if sink is None else tuple(sink.shape)
    acc = lse_dtype(q.dtype)
    return torch.empty_like(q), kv.new_empty(kv.shape), q.new_empty(dsink_shape, dtype=acc)


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
    return dq, dkv, None, (None if sink is None else dsink.to(sink.dtype)), None, None, None


_sparse_attention_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------- validation


def _drop_head_axis(name: str, t, packed: bool, dtypes, device):
    """Check ``t`` is [.., N, X] or [.., N, 1, X] (one leading batch dim unless packed); drop the 1."""
    base = 2 if packed else 3
    check_tensor(name, t, ndim=(base, base + 1), dtypes=dtypes, device=device)
    if t.dim() == base + 1:
        check_tensor(name, t, shape={base - 1: 1})
        t = t.squeeze(base - 1)
    return t


def normalise_inputs(q, kv, indices, scale, sink, dv):
    """Validate and bring inputs to the batched layout. Returns (q, kv, indices, sink, scale, dv, packed)."""
    check_tensor("q", q, ndim=(3, 4), dtypes=FLOAT_DTYPES)
    packed = q.dim() == 3
    device = q.device
    # kv and indices may carry a singleton head axis before their last dim ([.., Skv, 1, D], [.., S, 1, K])
    kv = _drop_head_axis("kv", kv, packed, FLOAT_DTYPES, device)
    indices = _drop_head_axis("indices", indices, packed, INDEX_DTYPES, device)
    if packed:
        q, kv, indices = q.unsqueeze(0), kv.unsqueeze(0), indices.unsqueeze(0)
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
        sink = sink.to(lse_dtype(q.dtype))
    if check_indices_enabled():
        check_index_range("indices", indices, kv.shape[1])
    indices = as_int32(indices, kv.shape[1])
    if indices.shape[-1] == 0:  # no slot at all: one "no key" slot gives the empty-row result
        indices = indices.new_full((b, s, 1), -1)
    return q.contiguous(), kv.contiguous(), indices.contiguous(), sink, scale, dv, packed
