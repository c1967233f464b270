"""Generic patch machinery, shared by every adapter; it knows no framework and no op.

- :mod:`.attributes`: idempotent, reversible attribute patches recorded under keys, with loud
  failures when a patch point moved (``patch_attribute``, ``revert_patches``, ...);
- :mod:`.versions`: version checks (``require_version``, ``UnsupportedVersion``);
- :mod:`.import_hooks`: post-import hooks (``when_imported``), so a patch is applied once its
  module has finished importing.

Each adapter (``dsa_plugins.adapters.*``) declares its own patches with these. Names resolve
lazily: the ``torch.backends`` entry point imports :mod:`.import_hooks` inside every
``import torch`` and must not pay for the rest.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "PatchPointMissing": "attributes",
    "applied_keys": "attributes",
    "is_patched": "attributes",
    "original_attribute": "attributes",
    "patch_attribute": "attributes",
    "revert_patches": "attributes",
    "UnsupportedVersion": "versions",
    "installed_version": "versions",
    "require_version": "versions",
    "pending_hooks": "import_hooks",
    "when_imported": "import_hooks",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dsa_plugins.patches' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
