"""The indexer's keys in fp8, opt-in: e4m3 with per-key and per-head scales, as DeepSeek-V3.2's own inference
quantises them (without the Hadamard rotation it applies first, which transformers' models also leave out).

transformers' DSA models keep the indexer's keys in the model dtype, so a generation step reads
``B x context x Di x 2`` bytes per layer (B 32 x 128K x 128: 1.07 GB, most of a long-context step).
:func:`enable_fp8_index_cache` scores the indexer in e4m3 instead: each key row and each query head
quantised with its own scale (``ops.quantize_indexer_fp8``: amax / 448, the query scales folded into the head
weights), the cache holding the keys' bytes and scales (``cache.update_fp8_index_keys``). Half the
bytes to cache and to read, and the selections of a model scored this way; they differ from the bf16
scores' where two keys' scores are closer than fp8 resolves (near-ties), so it is off unless asked for.

    n = dsa_plugins.hf.enable_fp8_index_cache(model)    # every V3.2-family indexer of the model
    model.generate(..., cache_implementation="static")
    dsa_plugins.hf.disable_fp8_index_cache(model)        # start a new cache after switching

``python -m dsa_plugins warmup MODEL --fp8-index`` compiles its programs ahead.

Served: the V3.2 family (``glm_moe_dsa``, ``deepseek_v32``, ``axk2``, ``hy_v4``, ``hy_v4_vl``,
``mistral_large4``, ``dots3_note``: ``constants.V32_FAMILY``) under ``dsa_tilelang``, in inference; a
forward that trains the indexer (the indexer loss) is refused.
"""

from __future__ import annotations

import torch

from ... import ops
from .constants import ATTN_NAME, V32_FAMILY
from .indexer_loss import served_indexers

__all__ = ["disable_fp8_index_cache", "enable_fp8_index_cache", "fp8_index_cache_enabled", "quantize_index_inputs"]

_FLAG_ATTR = "_dsa_fp8_index_cache"  # on each indexer module: True while enabled


def enable_fp8_index_cache(model: torch.nn.Module) -> int:
    """Score every V3.2-family indexer of ``model`` in fp8 and cache its keys in fp8 (idempotent);
    returns how many indexers. Raises ValueError when the model does not run under ``dsa_tilelang`` or
    has no such indexer. Turn it on before the cache's first forward: a cache that holds bf16 index keys
    is refused when fp8 keys are added to it."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl != ATTN_NAME:
        raise ValueError(f"enable_fp8_index_cache: the model runs attn_implementation={impl!r}; load it with "
                         f"attn_implementation={ATTN_NAME!r} (or model.set_attn_implementation({ATTN_NAME!r}))")
    indexers = served_indexers(model)
    if not indexers:
        raise ValueError(f"enable_fp8_index_cache: {type(model).__name__} has no indexer it serves (the V3.2 family: "
                         f"{', '.join(V32_FAMILY)})")
    for indexer in indexers:
        setattr(indexer, _FLAG_ATTR, True)
    return len(indexers)


def disable_fp8_index_cache(model: torch.nn.Module) -> int:
    """Score the indexers in the model dtype again; returns how many had fp8 on."""
    n = 0
    for module in model.modules():
        if getattr(module, _FLAG_ATTR, False):
            delattr(module, _FLAG_ATTR)
            n += 1
    return n


def fp8_index_cache_enabled(indexer: torch.nn.Module) -> bool:
    return getattr(indexer, _FLAG_ATTR, False) is True


def quantize_index_inputs(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor):
    """(q8 [B, S, Hi, Di], k8 [B, S, Di] float8_e4m3fn, k_scale [B, S] float32, weights [B, S, Hi] float32
    with the query scales folded in) from q [B, S, Hi, Di], k [B, S, Di], weights [B, S, Hi]. No host sync
    (a graph captures it); non-finite inputs give non-finite scores, as the bf16 path does."""
    b, s, hi, di = q.shape
    q8, k8, k_scale, w8 = ops.quantize_indexer_fp8(q.reshape(b * s, hi, di), k.reshape(b * s, di),
                                                   weights.reshape(b * s, hi), check_finite=False)
    return q8.view(b, s, hi, di), k8.view(b, s, di), k_scale.view(b, s), w8.view(b, s, hi)
