"""Megatron-core adapter: DSA modules (absorbed MLA + sparse attention + lightning indexer),
layer/block specs, and the patch that lets megatron's own spec functions build them.

Where things live: :mod:`.attention` (the DSA core attention and the absorbed-MLA self-attention
that hands the kv latent to ``sparse_mla``), :mod:`.indexer` (the lightning indexer on
``indexer_topk``), :mod:`.layers` (small shared modules: duplicated linear, Hadamard, rope
config), :mod:`.specs` (module specs and per-model presets), :mod:`.spec_patches` (megatron's
own spec functions patched to build them), :mod:`.keymap` (HF <-> Megatron checkpoint keys).

Importing this package does not import megatron; the submodules do. ``ADAPTER.register()`` (called
on ``import megatron.core`` by ``dsa_plugins._autoload``) applies
:func:`.spec_patches.apply_dsa_to_megatron` to megatron's spec module, at once when it is imported
already, else when it finishes importing (a post-import hook: ``import megatron.core`` stays as
cheap as it was).
"""

from __future__ import annotations

from ...patches.import_hooks import is_imported, when_imported
from .. import Adapter

SPECS_MODULE = "megatron.core.models.gpt.experimental_attention_variant_module_specs"
_state = {"wanted": False, "hooked": False}


def _apply_if_wanted(_module=None) -> None:
    if _state["wanted"]:
        from .spec_patches import apply_dsa_to_megatron

        apply_dsa_to_megatron()


def register() -> None:
    """Patch megatron's spec functions (idempotent; deferred until the spec module is imported)."""
    _state["wanted"] = True
    if is_imported(SPECS_MODULE):
        _apply_if_wanted()  # errors (unsupported version, moved patch point) raise here
    elif not _state["hooked"]:
        _state["hooked"] = True
        when_imported(SPECS_MODULE, _apply_if_wanted)


def unregister() -> None:
    """Restore megatron's spec functions (and cancel a deferred registration)."""
    _state["wanted"] = False
    from .spec_patches import revert_dsa_from_megatron

    revert_dsa_from_megatron()


def is_registered() -> bool:
    """True when the patch is applied, or will be as soon as megatron's spec module is imported."""
    from .spec_patches import is_applied

    return is_applied() or (_state["wanted"] and not is_imported(SPECS_MODULE))


ADAPTER = Adapter(
    name="megatron",
    trigger="megatron.core",
    register=register,
    unregister=unregister,
    is_registered=is_registered,
)

__all__ = ["ADAPTER", "register", "unregister", "is_registered"]
