"""Patches that make Megatron-core's own spec functions build dsa_plugins' DSA modules.

In megatron-core 0.16.x a config with ``experimental_attention_variant="dsa"`` reaches
``get_transformer_block_with_experimental_attention_variant_spec`` (what Megatron-LM's
``gpt_builders.py`` calls), whose dispatcher raises for "dsa" and whose backend helper accepts
Transformer Engine only. After :func:`apply_dsa_to_megatron`:

- ``get_experimental_attention_variant_module_spec`` returns our DSA spec for "dsa" (other variants
  go to the original);
- ``get_dsa_module_spec_for_backend`` (unused by 0.16's dispatcher, called by newer ones) returns
  our spec;
- ``_get_backend_spec_provider`` falls back to megatron's local provider when
  ``transformer_impl == "local"`` or Transformer Engine is missing (instead of asserting).

Every patch is recorded under the key ``"megatron.dsa"``: applying twice is a no-op and
:func:`revert_dsa_from_megatron` restores the originals.
"""

from __future__ import annotations

import functools

from packaging.version import Version

from ...patches.attributes import is_patched, patch_attribute, revert_patches
from ...patches.versions import require_version

PATCH_KEY = "megatron.dsa"
SUPPORTED = ("0.16.0", "0.17.0")  # [minimum, below); 0.19.x: backend_patches
_SPECS_MODULE = "megatron.core.models.gpt.experimental_attention_variant_module_specs"


def _specs_module():
    import importlib

    return importlib.import_module(_SPECS_MODULE)


def check_megatron_version() -> Version:
    """The megatron-core version, checked against ``SUPPORTED`` (a Megatron-LM source checkout on
    ``PYTHONPATH`` has no distribution metadata: its ``megatron.core.package_info`` is read then)."""
    return require_version("megatron-core", *SUPPORTED, version_module="megatron.core.package_info")


def apply_dsa_to_megatron(model: str | None = None, kernel_backend: str | None = None) -> bool:
    """Patch megatron's experimental-attention spec functions (see the module docstring).

    ``model``: indexer preset used when the config has no ``dsa_model`` attribute;
    ``kernel_backend``: ops backend for the built modules. Returns False when already applied."""
    check_megatron_version()
    mod = _specs_module()
    from . import specs

    if is_patched(mod, "get_experimental_attention_variant_module_spec", PATCH_KEY):
        return False

    original_dispatch = mod.get_experimental_attention_variant_module_spec
    original_backend = mod._get_backend_spec_provider

    def _ours(config, backend=None):
        return specs.get_dsa_module_spec(config, backend, model=model, kernel_backend=kernel_backend)

    @functools.wraps(original_dispatch)
    def get_experimental_attention_variant_module_spec(config, backend=None):
        if getattr(config, "experimental_attention_variant", None) == "dsa":
            if backend is None:
                backend = mod._get_backend_spec_provider(config=config)
            return _ours(config, backend)
        return original_dispatch(config=config, backend=backend)

    @functools.wraps(original_backend)
    def _get_backend_spec_provider(config):
        if getattr(config, "experimental_attention_variant", None) == "dsa" and (
            getattr(config, "transformer_impl", None) == "local" or not _have_te()
        ):
            return specs.LocalSpecProvider()
        return original_backend(config=config)

    @functools.wraps(getattr(mod, "get_dsa_module_spec_for_backend", _ours))
    def get_dsa_module_spec_for_backend(config, backend=None):
        return _ours(config, backend)

    patch_attribute(
        mod, "get_experimental_attention_variant_module_spec", get_experimental_attention_variant_module_spec,
        key=PATCH_KEY,
    )
    patch_attribute(mod, "_get_backend_spec_provider", _get_backend_spec_provider, key=PATCH_KEY)
    patch_attribute(
        mod, "get_dsa_module_spec_for_backend", get_dsa_module_spec_for_backend, key=PATCH_KEY, allow_missing=True
    )
    return True


def revert_dsa_from_megatron() -> int:
    """Undo :func:`apply_dsa_to_megatron`; returns how many attributes were restored."""
    return revert_patches(PATCH_KEY)


def is_applied() -> bool:
    import sys

    mod = sys.modules.get(_SPECS_MODULE)
    return mod is not None and is_patched(mod, "get_experimental_attention_variant_module_spec", PATCH_KEY)


def _have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
