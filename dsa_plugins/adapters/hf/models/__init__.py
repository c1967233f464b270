"""Which model type gets which treatment under ``dsa_tilelang``: the one table, :data:`MODELS`.

Each entry names the modeling module (patched by a post-import hook once it has finished
importing), the path its attention takes, and the patch function, which lives in the module of its
family: :mod:`.v32_family` (absorbed MLA + fused indexer top-k, the projections being the only
per-model part), :mod:`.deepseek_v4` (window + compressed rows with sinks), :mod:`.glm5_next`
(k-pool indexer whose top-k is the mask). Every patch is inert unless a model runs under
dsa_tilelang, so eager / sdpa models in the same process are untouched.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

from ....patches.attributes import applied_keys
from ..constants import PATCH_KEY, UNSUPPORTED  # UNSUPPORTED: not served, with the reason (see the README)
from . import deepseek_v4, glm5_next, v32_family
from .v32_family import mistral_large4_projection, rope_first_projection


@dataclass(frozen=True)
class ModelEntry:
    """``module``: the modeling module to patch; ``path``: what runs under dsa_tilelang;
    ``patch(module)``: applies the patches (idempotent, keys ``hf.<model_type>``)."""

    model_type: str
    module: str
    path: str
    patch: Callable


def _modeling(model_type: str) -> str:
    return f"transformers.models.{model_type}.modeling_{model_type}"


_ABSORBED = "absorbed MLA + fused indexer top-k"

MODELS: dict[str, ModelEntry] = {
    entry.model_type: entry
    for entry in (
        ModelEntry("glm_moe_dsa", _modeling("glm_moe_dsa"), _ABSORBED + " (shared-indexer layers)",
                   v32_family.patcher("glm_moe_dsa", "GlmMoeDsaAttention", "GlmMoeDsaIndexer",
                                      rope_first_projection("apply_rotary_pos_emb_interleave"))),
        ModelEntry("deepseek_v32", _modeling("deepseek_v32"), _ABSORBED,
                   v32_family.patcher("deepseek_v32", "DeepseekV32Attention", "DeepseekV32Indexer",
                                      rope_first_projection("apply_rotary_pos_emb"))),
        ModelEntry("axk2", _modeling("axk2"), _ABSORBED,
                   v32_family.patcher("axk2", "AXK2Attention", "AXK2Indexer",
                                      rope_first_projection("apply_rotary_pos_emb"))),
        ModelEntry("hy_v4", _modeling("hy_v4"), _ABSORBED + ", per-head sinks",
                   v32_family.patcher("hy_v4", "HYV4Attention", "HYV4Indexer",
                                      rope_first_projection("apply_rotary_pos_emb", rope_first=False))),
        ModelEntry("hy_v4_vl", _modeling("hy_v4_vl"), _ABSORBED + ", per-head sinks (text; vision tower on SDPA)",
                   v32_family.patcher("hy_v4_vl", "HYV4VLAttention", "HYV4VLIndexer",
                                      rope_first_projection("apply_rotary_pos_emb", rope_first=False))),
        ModelEntry("mistral_large4", _modeling("mistral_large4"), _ABSORBED + " (text; Pixtral tower on SDPA)",
                   v32_family.patcher("mistral_large4", "MistralLarge4TextAttention", "MistralLarge4TextIndexer",
                                      mistral_large4_projection)),
        ModelEntry("dots3_note", _modeling("dots3_note"), _ABSORBED + " on the indexed layers (sliding ones on SDPA)",
                   v32_family.patcher("dots3_note", "Dots3NoteTextAttention", "Dots3NoteTextIndexer",
                                      rope_first_projection("apply_rotary_pos_emb_interleave"))),
        ModelEntry("deepseek_v4", _modeling("deepseek_v4"),
                   "sparse_attention with sinks over window + CSA top-k / HCA compressed rows", deepseek_v4.patch),
        ModelEntry("glm5_next", _modeling("glm5_next"), "absorbed MLA over the selected k-pools + visible tail",
                   glm5_next.patch),
    )
}


def _models_dir() -> str | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "models")


def model_available(model_type: str) -> bool:
    """Whether the installed transformers ships this model type (without importing transformers)."""
    root = _models_dir()
    return root is not None and os.path.isdir(os.path.join(root, model_type))


def available_models() -> list[str]:
    """Supported model types that the installed transformers ships."""
    return [m for m in MODELS if model_available(m)]


def supported_models() -> dict[str, str]:
    """model_type -> "patched" | "available ..." | "not in this transformers" | why it is unsupported."""
    applied = set(applied_keys())
    status = {}
    for model_type in MODELS:
        if not model_available(model_type):
            status[model_type] = "not in this transformers"
        elif f"{PATCH_KEY}.{model_type}" in applied:
            status[model_type] = "patched"
        else:
            status[model_type] = "available (patched when its modeling module is imported)"
    status.update(UNSUPPORTED)
    return status


def patch_model(model_type: str, module=None) -> None:
    """Apply the patches of one model type to its modeling module (imported here when not given)."""
    if model_type not in MODELS:
        if model_type in UNSUPPORTED:
            raise NotImplementedError(f"dsa_plugins: {model_type} is not supported: {UNSUPPORTED[model_type]}")
        raise KeyError(f"dsa_plugins: unknown model type {model_type!r}; known: {sorted(MODELS)}")
    entry = MODELS[model_type]
    entry.patch(importlib.import_module(entry.module) if module is None else module)


__all__ = ["MODELS", "UNSUPPORTED", "ModelEntry", "available_models", "model_available", "patch_model",
           "supported_models"]
