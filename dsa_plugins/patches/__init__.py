"""Idempotent, reversible patches of framework code (see ``_core``)."""

from ._core import (
    PatchPointMissing,
    UnsupportedVersion,
    applied_keys,
    installed_version,
    is_patched,
    patch_attribute,
    require_version,
    revert_patches,
)

__all__ = [
    "PatchPointMissing",
    "UnsupportedVersion",
    "applied_keys",
    "installed_version",
    "is_patched",
    "patch_attribute",
    "require_version",
    "revert_patches",
]
