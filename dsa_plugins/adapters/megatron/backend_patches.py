"""Patches that make dsa_plugins a DSA kernel backend of megatron-core 0.19.x.

megatron picks the module of ``config.dsa_kernel_backend`` from
``dsa_kernels._BACKEND_MODULE_NAME_BY_BACKEND`` and validates the name in
``TransformerConfig.__post_init__``. After :func:`apply_backend_patches`:

- ``"dsa_plugins"`` names :mod:`dsa_plugins.adapters.megatron.backend` and is accepted by the
  config validation (``TransformerConfig(..., dsa_kernel_backend="dsa_plugins")`` works);
- a config left at ``"none"`` runs dsa_plugins too (one log line says so), so training scripts
  need no change; ``DSA_PLUGINS_MEGATRON_TAKEOVER=0`` keeps ``"none"`` on megatron's torch path.
  An explicit ``"tilelang"`` / ``"cudnn"``, or ``attention_backend="unfused"``, is respected;
- ``DSAttention.forward`` records which layer runs (the loss tracker needs its number).

Everything is recorded under the key ``"megatron.backend"``: applying twice is a no-op and
:func:`revert_backend_patches` restores the originals.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

from ...common.settings import warn_once
from ...patches.attributes import is_patched, patch_attribute, revert_patches

PATCH_KEY = "megatron.backend"
BACKEND_NAME = "dsa_plugins"
BACKEND_MODULE = "dsa_plugins.adapters.megatron.backend"
KERNELS_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa_kernels"
DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"
CONFIG_MODULE = "megatron.core.transformer.transformer_config"
ENV_TAKEOVER = "DSA_PLUGINS_MEGATRON_TAKEOVER"


def takeover_enabled() -> bool:
    """Whether configs left at ``dsa_kernel_backend="none"`` run dsa_plugins (default: yes)."""
    return os.environ.get(ENV_TAKEOVER, "1").strip().lower() not in ("0", "false", "no", "off")


def apply_config_patches(config_module=None) -> bool:
    """Let ``TransformerConfig`` accept ``dsa_kernel_backend="dsa_plugins"``. False when already applied."""
    tc = config_module or importlib.import_module(CONFIG_MODULE)
    if is_patched(tc, "_validate_dsa_kernel_backend_dependencies", PATCH_KEY):
        return False
    utils = importlib.import_module("megatron.core.utils")
    original = tc._validate_dsa_kernel_backend_dependencies  # imported by name: the copy the config calls

    @functools.wraps(original)
    def _validate_dsa_kernel_backend_dependencies(dsa_kernel_backend):
        if dsa_kernel_backend == BACKEND_NAME:
            return None  # runs wherever torch does (the kernels on Hopper, the reference elsewhere)
        return original(dsa_kernel_backend)

    patch_attribute(tc, "_validate_dsa_kernel_backend_dependencies", _validate_dsa_kernel_backend_dependencies,
                    key=PATCH_KEY)
    valid = tuple(utils._VALID_DSA_KERNEL_BACKENDS)
    if BACKEND_NAME not in valid:
        patch_attribute(utils, "_VALID_DSA_KERNEL_BACKENDS", valid + (BACKEND_NAME,), key=PATCH_KEY)
    return True


def apply_dsa_patches(dsa_module=None) -> bool:
    """Register the backend module, the ``"none"`` takeover and the layer tracking."""
    from .backend import track_layer

    dsa = dsa_module or importlib.import_module(DSA_MODULE)
    kernels = sys.modules.get(KERNELS_MODULE) or importlib.import_module(KERNELS_MODULE)
    if is_patched(kernels, "_get_dsa_kernel_backend", PATCH_KEY):
        return False
    original_get = kernels._get_dsa_kernel_backend

    @functools.wraps(original_get)
    def _get_dsa_kernel_backend(config):
        backend = config.dsa_kernel_backend
        if backend == "none" and takeover_enabled():
            warn_once("megatron-takeover",
                      f"dsa_plugins: DSA layers with dsa_kernel_backend='none' run on dsa_plugins' kernels "
                      f"(set dsa_kernel_backend explicitly, or {ENV_TAKEOVER}=0, to keep megatron's torch path)")
            return BACKEND_NAME
        return original_get(config)

    table = {**kernels._BACKEND_MODULE_NAME_BY_BACKEND, BACKEND_NAME: BACKEND_MODULE}
    patch_attribute(kernels, "_BACKEND_MODULE_NAME_BY_BACKEND", table, key=PATCH_KEY)
    patch_attribute(kernels, "_get_dsa_kernel_backend", _get_dsa_kernel_backend, key=PATCH_KEY)
    patch_attribute(dsa.DSAttention, "forward", track_layer(dsa.DSAttention.__dict__["forward"]), key=PATCH_KEY)
    return True


def revert_backend_patches() -> int:
    """Undo both patch sets; returns how many attributes were restored."""
    kernels = sys.modules.get(KERNELS_MODULE)
    if kernels is not None and getattr(kernels, "_BACKEND_SELECTION", None) == BACKEND_MODULE:
        kernels._BACKEND, kernels._BACKEND_SELECTION = None, None  # megatron's cache of the loaded module
    return revert_patches(PATCH_KEY)


def is_applied() -> bool:
    kernels = sys.modules.get(KERNELS_MODULE)
    return kernels is not None and is_patched(kernels, "_get_dsa_kernel_backend", PATCH_KEY)
