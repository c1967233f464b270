"""Megatron-core adapter: DSA modules (absorbed MLA + sparse attention + lightning indexer),
layer/block specs, and the patch that lets megatron's own spec functions build them.

Where things live: :mod:`.attention` (the DSA core attention and the absorbed-MLA self-attention
that hands the kv latent to ``sparse_mla``), :mod:`.indexer` (the lightning indexer on
``indexer_topk``), :mod:`.layers` (small shared modules: duplicated linear, Hadamard, rope
config), :mod:`.specs` (module specs and per-model presets), :mod:`.spec_patches` (megatron's
own spec functions patched to build them), :mod:`.keymap` (HF <-> Megatron checkpoint keys).

Two megatron generations are served. megatron-core 0.16.x has no DSA of its own that runs:
:mod:`.spec_patches` makes its spec functions build our modules. megatron-core 0.19.x has its own
DSA with kernel backends: :mod:`.backend` is one (``dsa_kernel_backend="dsa_plugins"``) and
:mod:`.backend_patches` registers it, taking over configs left at ``"none"``.

Importing this package does not import megatron; the submodules do. ``ADAPTER.register()`` (called
on ``import megatron.core`` by ``dsa_plugins._autoload``) applies the patches of the installed
version to megatron's modules, at once when they are imported already, else when they finish
importing (post-import hooks: ``import megatron.core`` stays as cheap as it was).
"""

from __future__ import annotations

from ...patches.import_hooks import is_imported, when_imported
from ...patches.versions import UnsupportedVersion, installed_version
from .. import Adapter

SPECS_MODULE = "megatron.core.models.gpt.experimental_attention_variant_module_specs"
CONFIG_MODULE = "megatron.core.transformer.transformer_config"
DSA_MODULE = "megatron.core.transformer.experimental_attention_variant.dsa"

# megatron-core releases and how each is served, [minimum, below)
SPEC_PATCH_VERSIONS = ("0.16.0", "0.17.0")  # our DSA modules through megatron's spec functions
BACKEND_VERSIONS = ("0.19.0", "0.20.0")  # megatron's own DSA with dsa_plugins as its kernel backend

_state = {"wanted": False, "hooked": False}


def megatron_version():
    """The megatron-core version (a source checkout's ``package_info`` when there is no metadata)."""
    from packaging.version import Version

    version = installed_version("megatron-core")
    if version is None:
        from megatron.core import package_info

        version = Version(package_info.__version__)
    return version


def megatron_mode() -> str:
    """"specs" (0.16.x) or "backend" (0.19.x); UnsupportedVersion names both ranges otherwise."""
    from packaging.version import Version

    version = megatron_version()
    for mode, (lo, hi) in (("specs", SPEC_PATCH_VERSIONS), ("backend", BACKEND_VERSIONS)):
        if Version(lo) <= version < Version(hi):
            return mode
    raise UnsupportedVersion(
        f"dsa_plugins supports megatron-core {SPEC_PATCH_VERSIONS[0]} <= v < {SPEC_PATCH_VERSIONS[1]} (its own DSA "
        f"modules) and {BACKEND_VERSIONS[0]} <= v < {BACKEND_VERSIONS[1]} (as the DSA kernel backend "
        f"dsa_kernel_backend='dsa_plugins'); found {version}"
    )


def _when_ready(module: str, apply) -> None:
    def hook(_module=None):
        if _state["wanted"]:
            apply()

    if is_imported(module):
        hook()  # errors (unsupported version, moved patch point) raise here
    else:
        when_imported(module, hook)


def register() -> None:
    """0.16.x: patch megatron's spec functions to build our modules; 0.19.x: register dsa_plugins as
    megatron's DSA kernel backend (and take over configs left at "none"). Idempotent; deferred
    until the patched modules are imported."""
    mode = megatron_mode()
    _state["wanted"] = True
    if _state["hooked"]:
        return
    _state["hooked"] = True
    if mode == "specs":
        from .spec_patches import apply_dsa_to_megatron

        _when_ready(SPECS_MODULE, apply_dsa_to_megatron)
    else:
        from .backend_patches import apply_config_patches, apply_dsa_patches

        _when_ready(CONFIG_MODULE, apply_config_patches)
        _when_ready(DSA_MODULE, apply_dsa_patches)


def unregister() -> None:
    """Restore megatron (and cancel a deferred registration)."""
    _state["wanted"] = False
    _state["hooked"] = False
    from .backend_patches import revert_backend_patches
    from .spec_patches import revert_dsa_from_megatron

    revert_dsa_from_megatron()
    revert_backend_patches()


def is_registered() -> bool:
    """True when the patches are applied, or will be once megatron's modules are imported."""
    from .backend_patches import is_applied as backend_applied
    from .spec_patches import is_applied as specs_applied

    if specs_applied() or backend_applied():
        return True
    return _state["wanted"] and not (is_imported(SPECS_MODULE) and is_imported(DSA_MODULE))


ADAPTER = Adapter(
    name="megatron",
    trigger="megatron.core",
    register=register,
    unregister=unregister,
    is_registered=is_registered,
)

__all__ = ["ADAPTER", "register", "unregister", "is_registered"]
