"""The sparse-stage indexer KL loss fused into the sparse attention's backward.

In DeepSeek-V3.2's sparse training stage the indexer's target p_attn is the head sum of the sparse
attention's own probabilities over the same top-k slots (DSA.md 1.2). Computing it apart means
gathering every selected kv row a second time, as much memory traffic as the attention forward
(at T 8192, k 2048, Dqk 576: 19 GB, about 5 ms on an H200). The attention backward recomputes
exactly these probabilities, so with :class:`FusedIndexerLoss` it emits their head sum and the
loss, and its gradients for index_q, index_k and weights, are computed right there.

The price: the loss value exists only once the backward has run (``FusedIndexerLoss.value``, and
``on_value`` callbacks, for logging). Its gradient enters with ``weight`` (the factor of the loss
in the objective: a float, or a callable read at backward time, e.g. a loss-scale tensor).

    loss = FusedIndexerLoss(index_q, index_k, weights, weight=0.01)
    out = sparse_mla(q, kv, topk, w_vc, scale, indexer_loss=loss)   # or sparse_attention(...)
    objective(out).backward()        # also fills index_q.grad, ... through the indexer loss
    log(loss.value)

index_q [T, Hi, Di], index_k [Tkv, Di], weights [T, Hi] are packed over the batch (query row
b * S + s, key row b * Skv + j). The indexer's inputs are detached from the main model by the caller.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
from torch import Tensor

from ..common.settings import deterministic_enabled, warn_once
from ..common.indices import global_rows
from ..common.validation import FLOAT_DTYPES, check_tensor
from ..reference.indexer_loss import indexer_kl_loss_reference
from .attention_custom_ops import attention_backward
from .backend import autocast_floats, choose_kernel, kernel_shape_reason

__all__ = ["FusedIndexerLoss"]


class FusedIndexerLoss:
    """Inputs of the sparse-stage indexer loss and, after the backward, its value.

    index_q [T, Hi, Di], index_k [Tkv, Di], weights [T, Hi] (packed over the batch). weight: the
    loss's factor in the objective (float or zero-argument callable returning a float or a
    scalar tensor, read when the backward runs). on_value: callables given the loss value (scalar
    tensor, fp32 or fp64 like the inputs: the KL mean over query rows, before ``weight``) when the
    backward runs. row_weights [T] (optional): each query row's factor in place of the mean's
    1 / T (Megatron: 1 / n_valid on real tokens, 0 on padding; 1 for a per-token sum).
    target_group (optional): a process group whose ranks hold the other heads of the same rows
    (tensor parallelism): the head-summed probabilities are all-reduced over it before they are
    normalised, so every rank computes the loss of all heads.
    index_lse [T] (optional): the logsumexp of each row's selected indexer scores
    (``indexer_topk(..., return_lse=True)``): the loss kernel then skips its own pass over the logits.
    Made inside torch.autocast, float32 index_q and index_k are kept in the autocast dtype (the dtype the
    indexer scored them in), so the loss runs on the kernels as the attention does.
    """

    def __init__(self, index_q: Tensor, index_k: Tensor, weights: Tensor,
                 weight: Union[float, Callable[[], Union[float, Tensor]]] = 1.0,
                 on_value: Union[Callable[[Tensor], None], None] = None,
                 row_weights: Union[Tensor, None] = None, target_group=None, index_lse: Union[Tensor, None] = None):
        check_tensor("index_q", index_q, ndim=3, dtypes=FLOAT_DTYPES)
        index_q, index_k = autocast_floats(index_q, index_k)
        t, hi, di = index_q.shape
        check_tensor("index_k", index_k, ndim=2, dtypes=FLOAT_DTYPES, device=index_q.device, shape={1: di})
        check_tensor("weights", weights, ndim=2, dtypes=FLOAT_DTYPES, device=index_q.device, shape={0: t, 1: hi})
        if not (callable(weight) or isinstance(weight, (int, float))):
            raise TypeError(f"weight must be a float or a callable, got {type(weight).__name__}")
        self.index_q, self.index_k, self.weights = index_q, index_k, weights
        if row_weights is not None:
            check_tensor("row_weights", row_weights, ndim=1, dtypes=FLOAT_DTYPES, device=index_q.device, shape={0: t},
                         unit_stride=False)
        if index_lse is not None:
            check_tensor("index_lse", index_lse, ndim=1, dtypes=FLOAT_DTYPES, device=index_q.device, shape={0: t})
            index_lse = index_lse.detach().float()
        self.index_lse = index_lse
        self.weight = weight
        self.row_weights = row_weights
        self.target_group = target_group
        self.on_value = [] if on_value is None else [on_value]
        self.value: Tensor | None = None

    def _check_against(self, q4: Tensor, kv3: Tensor) -> None:
        b, s = q4.shape[:2]
        if self.index_q.shape[0] != b * s:
            raise ValueError(f"index_q must have B*S = {b * s} rows (packed over the batch), "
                             f"got {tuple(self.index_q.shape)}")
        if self.index_k.shape[0] != b * kv3.shape[1]:
            raise ValueError(f"index_k must have B*Skv = {b * kv3.shape[1]} rows (packed over the batch), "
                             f"got {tuple(self.index_k.shape)}")
        if self.index_q.device != q4.device:
            raise ValueError(f"index_q must be on {q4.device} (the device of q), got {self.index_q.device}")

    def _weight(self, device, dtype=torch.float32) -> Tensor:
        w = self.weight() if callable(self.weight) else self.weight
        if isinstance(w, Tensor):
            return w.detach().to(device=device, dtype=dtype).reshape(())
        return torch.tensor(float(w), dtype=dtype, device=device)

    def _publish(self, value: Tensor) -> None:
        self.value = value
        for fn in self.on_value:
            fn(value)


def _loss_and_grads(loss: FusedIndexerLoss, probs: Tensor, rows: Tensor, backend: str, deterministic: bool = False):
    """(value, d_index_q, d_index_k, d_weights) of the loss whose attention target is ``probs``
    [T, K] (head sums, unnormalised). TileLang kernels by the backend rules, else the reference."""
    iq, ik, w = loss.index_q.detach(), loss.index_k.detach(), loss.weights.detach()
    acc = torch.float64 if iq.dtype == torch.float64 else torch.float32
    weight = loss._weight(iq.device, acc)
    t = iq.shape[0]
    rows_w = (torch.full((t,), 1.0 / max(t, 1), dtype=acc, device=iq.device) if loss.row_weights is None
              else loss.row_weights.detach().to(acc))
    reason = kernel_shape_reason("indexer_kl_loss", num_heads=64, dqk=576, index_heads=iq.shape[1],
                                 index_dim=iq.shape[2], dtype=iq.dtype)
    if choose_kernel(backend, "indexer_kl_loss", (iq, ik), reason):
        from ..kernels.indexer_loss import indexer_kl_loss_from_probs

        grad_rows = (weight * rows_w).float().contiguous()
        loss_rows, (d_iq, d_ik, d_w) = indexer_kl_loss_from_probs(
            iq.contiguous(), ik.contiguous(), w.float().contiguous(), rows, probs.float().contiguous(), grad_rows,
            deterministic=deterministic,
            index_lse=None if loss.index_lse is None else loss.index_lse.contiguous())
        return (loss_rows * rows_w).sum(), d_iq, d_ik, d_w
    with torch.enable_grad():
        leaves = [x.requires_grad_() for x in (iq.clone(), ik.clone(), w.clone())]
        value = indexer_kl_loss_reference(*leaves, None, None, None, None, topk_indices=rows, attn_probs=probs,
                                          row_weights=rows_w)
        grads = torch.autograd.grad(value, leaves, grad_outputs=weight.to(value.dtype))
    return value.detach(), *grads


class SparseAttentionIndexerLoss(torch.autograd.Function):
    """sparse attention (batched layout, inputs normalised) whose backward also runs the indexer loss."""

    @staticmethod
    def forward(ctx, q, kv, indices, sink, index_q, index_k, weights, loss, scale, dv, backend):
        out, lse = torch.ops.dsa_plugins.sparse_attention_fwd(q, kv, indices, sink, scale, dv, backend)
        ctx.save_for_backward(q, kv, indices, sink, out, lse)
        ctx.loss, ctx.scale, ctx.dv, ctx.backend = loss, scale, dv, backend
        ctx.deterministic = deterministic_enabled()
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv, indices, sink, out, lse = ctx.saved_tensors
        loss: FusedIndexerLoss = ctx.loss
        dq, dkv, dsink, probs = attention_backward(
            q, kv, indices, sink, out, lse, dout.contiguous(), ctx.scale, ctx.dv, ctx.backend, ctx.deterministic,
            return_probs=True, dkv_dtype=kv.dtype,
        )
        rows = global_rows(indices, kv.shape[1])
        probs = probs.reshape(rows.shape)
        if loss.target_group is not None:  # the other heads of these rows live on the group's other ranks
            probs = probs.contiguous()
            torch.distributed.all_reduce(probs, group=loss.target_group)
        value, d_iq, d_ik, d_w = _loss_and_grads(loss, probs, rows, ctx.backend, ctx.deterministic)
        loss._publish(value)
        return (dq, dkv, None, None if sink is None else dsink.to(sink.dtype),
                d_iq.to(loss.index_q.dtype), d_ik.to(loss.index_k.dtype), d_w.to(loss.weights.dtype),
                None, None, None, None)


@torch.compiler.disable
def attention_with_indexer_loss(q4, kv3, idx3, sink, scale, dv, backend, loss: FusedIndexerLoss) -> Tensor:
    """Entry from sparse_attention (inputs validated and in the batched layout). Returns out."""
    if not isinstance(loss, FusedIndexerLoss):
        raise TypeError(f"indexer_loss must be a FusedIndexerLoss, got {type(loss).__name__}")
    loss._check_against(q4, kv3)
    if not torch.is_grad_enabled():
        warn_once("fused-indexer-loss-no-grad",
                  "sparse_attention(indexer_loss=...) under no_grad: no backward runs, so the loss is not computed")
    return SparseAttentionIndexerLoss.apply(q4, kv3, idx3, sink, loss.index_q, loss.index_k, loss.weights, loss,
                                            scale, dv, backend)
