"""Training the indexer while fine-tuning a Hugging Face DSA model: the indexer KL loss, opt-in.

In transformers' own models the indexer gets no gradient (its top-k is not differentiable), so
fine-tuning the attention slowly misaligns the keys it selects with the ones the attention would
weigh. :func:`enable_indexer_loss` adds DeepSeek-V3.2's sparse-stage loss: KL(p || softmax(I)) over
each query's selected keys, where p is the head sum of the attention's own probabilities, fused into
the attention backward (:class:`~dsa_plugins.ops.FusedIndexerLoss`, as in the Megatron adapter: no
second gather of the latent). The indexer's inputs are detached, so the loss trains the indexer only,
and its gradient enters with ``weight``; the model's own loss is unchanged.

    handle = dsa_plugins.hf.enable_indexer_loss(model, weight=0.01)
    loss = model(**batch).loss
    loss.backward()                      # also fills the indexers' .grad through the indexer loss
    log(loss.item(), handle.mean())      # the indexer KL of that backward, averaged over layers
    handle.remove()                      # or dsa_plugins.hf.disable_indexer_loss(model)

Served: the V3.2 family (``glm_moe_dsa``, ``deepseek_v32``, ``axk2``, ``hy_v4``, ``hy_v4_vl``,
``mistral_large4``, ``dots3_note``: ``constants.V32_FAMILY``) under ``dsa_tilelang``, in training mode
with gradients on and no earlier keys in a cache; layers that reuse another layer's selection (GLM-5's "shared"
layers) have no indexer to train.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import ops
from ...common.settings import warn_once
from .constants import ATTN_NAME, V32_FAMILY

__all__ = ["IndexerLossHandle", "disable_indexer_loss", "enable_indexer_loss", "pending_loss", "served_indexers",
           "stash_loss"]

_CONFIG_ATTR = "_dsa_indexer_loss"  # on each indexer module: its IndexerLossHandle
_PENDING_ATTR = "_dsa_pending_loss"  # on each indexer module: the FusedIndexerLoss of the current forward


@dataclass
class IndexerLossHandle:
    """What :func:`enable_indexer_loss` returns. ``weight``: the loss's factor in the objective (a
    float, or a zero-argument callable read at backward time). ``values``: the loss of each indexed
    layer in the backwards since the last :meth:`reset` (scalar fp32 tensors, never synced to the host
    here). ``on_value``: extra callables given each value."""

    model: torch.nn.Module
    weight: float | Callable[[], float | torch.Tensor]
    on_value: list[Callable[[torch.Tensor], None]] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    layers: int = 0

    def _record(self, value: torch.Tensor) -> None:
        self.values.append(value.detach())
        for fn in self.on_value:
            fn(value)

    def mean(self, reset: bool = True) -> torch.Tensor | None:
        """The mean of the recorded values (a tensor; None if none), then forget them (``reset``)."""
        if not self.values:
            return None
        out = torch.stack([v.float() for v in self.values]).mean()
        if reset:
            self.reset()
        return out

    def reset(self) -> None:
        self.values.clear()

    def remove(self) -> None:
        """Turn the loss off again (:func:`disable_indexer_loss`)."""
        disable_indexer_loss(self.model)


#: set on the forward of the indexer classes the V3.2-family patch drives (``models/v32_family.py``)
SERVED_MARKER = "__dsa_indexer__"


def served_indexers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The indexer modules the V3.2-family patches drive (attention modules' ``indexer`` children)."""
    found = []
    for module in model.modules():
        indexer = getattr(module, "indexer", None)
        if isinstance(indexer, torch.nn.Module) and getattr(type(indexer).forward, SERVED_MARKER, False) is True:
            found.append(indexer)
    return found


def enable_indexer_loss(model: torch.nn.Module, weight: float | Callable = 1.0,
                        on_value: Callable[[torch.Tensor], None] | None = None) -> IndexerLossHandle:
    """Train the indexers of ``model`` with the sparse indexer KL loss, fused into the attention
    backward; returns the :class:`IndexerLossHandle` (values, ``remove()``). Idempotent: a second call
    replaces the weight and callback. Raises ValueError when the model does not run under
    ``dsa_tilelang`` or has no indexer this loss serves."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != ATTN_NAME:
        raise ValueError(f"enable_indexer_loss: the model runs attn_implementation={impl!r}; load it with "
                         f"attn_implementation={ATTN_NAME!r} (or model.set_attn_implementation({ATTN_NAME!r}))")
    if not (callable(weight) or isinstance(weight, (int, float))):
        raise TypeError(f"weight must be a float or a callable, got {type(weight).__name__}")
    indexers = served_indexers(model)
    if not indexers:
        raise ValueError(f"enable_indexer_loss: {type(model).__name__} has no indexer this loss serves (the V3.2 "
                         f"family: {', '.join(V32_FAMILY)})")
    handle = IndexerLossHandle(model, weight, [on_value] if on_value is not None else [], layers=len(indexers))
    for indexer in indexers:
        setattr(indexer, _CONFIG_ATTR, handle)
    return handle


def disable_indexer_loss(model: torch.nn.Module) -> int:
    """Turn the indexer loss off; returns how many indexers had it."""
    n = 0
    for module in model.modules():
        if hasattr(module, _CONFIG_ATTR):
            delattr(module, _CONFIG_ATTR)
            if hasattr(module, _PENDING_ATTR):
                delattr(module, _PENDING_ATTR)
            n += 1
    return n


def loss_handle(indexer: torch.nn.Module, mask, query_rows: int) -> IndexerLossHandle | None:
    """The handle when this indexer call should build the loss: enabled, training, gradients on, and
    the keys are this call's own (no past keys in a cache: transformers makes a cache in training
    forwards too, unless ``use_cache=False``; an empty one changes nothing)."""
    handle = getattr(indexer, _CONFIG_ATTR, None)
    if handle is None or not indexer.training or not torch.is_grad_enabled():
        return None
    if torch.compiler.is_compiling():
        warn_once("hf:indexer_loss_compile", "dsa_tilelang: the indexer loss is skipped in a torch.compile'd "
                  "forward (it runs in eager training)")
        return None
    if mask.kv_length != query_rows:
        warn_once("hf:indexer_loss_cache", "dsa_tilelang: the indexer loss is skipped in calls whose cache holds "
                  "earlier keys (training forwards start from an empty cache, or pass use_cache=False)")
        return None
    return handle


def stash_loss(indexer: torch.nn.Module, handle: IndexerLossHandle, q: torch.Tensor, k: torch.Tensor,
               w: torch.Tensor, mask, index_lse: torch.Tensor | None = None) -> None:
    """Keep the loss inputs of this forward for the attention call that follows.

    q [B, S, Hi, Di], k [B, S, Di], w [B, S, Hi] fp32 (with gradients, inputs detached from the model);
    padded query rows get no weight, every real row 1 / (number of real rows). index_lse [B * S]: the
    selection's logsumexp from ``select_topk`` (None: the loss computes it)."""
    b, s, hi, di = q.shape
    pad = mask.local_padding()
    row_weights = None
    if pad is not None and pad.shape[-1] == s:
        real = pad.reshape(-1).to(torch.float32)
        row_weights = real / real.sum().clamp_min(1.0)
    loss = ops.FusedIndexerLoss(q.reshape(b * s, hi, di), k.reshape(b * s, di), w.reshape(b * s, hi),
                                weight=handle.weight, on_value=handle._record, row_weights=row_weights,
                                index_lse=index_lse)
    setattr(indexer, _PENDING_ATTR, loss)


def pending_loss(attention: torch.nn.Module):
    """The FusedIndexerLoss stashed by this attention module's indexer in the current forward, if any
    (taken: a second call gets None). Plain attribute reads, so that a compiled graph (generation)
    traces them; the loss itself is for eager training."""
    indexer = getattr(attention, "indexer", None)
    loss = getattr(indexer, _PENDING_ATTR, None) if isinstance(indexer, torch.nn.Module) else None
    if loss is not None:
        setattr(indexer, _PENDING_ATTR, None)
    return loss
