"""Idempotent, reversible monkey-patching with loud failures when a patch point moved.

Every patch is recorded under a *key* (for example ``"hf.glm_moe_dsa"``): applying the same key
twice is a no-op, and ``revert_patches(key)`` restores the originals in reverse order. A patched
object carries the marker attribute ``__dsa_plugins_patch__`` so a second call can tell.
"""

from __future__ import annotations

import importlib.metadata
import threading
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

_MARKER = "__dsa_plugins_patch__"
_MISSING = object()


class PatchPointMissing(RuntimeError):
    """The attribute a patch expects is not where it should be (the framework moved it)."""


class UnsupportedVersion(RuntimeError):
    """The installed framework version is outside the range a patch was written for."""


@dataclass
class _Record:
    key: str
    owner: Any
    name: str
    original: Any


_records: list[_Record] = []
_lock = threading.RLock()


def patch_attribute(owner: Any, name: str, new: Any, *, key: str, allow_missing: bool = False) -> bool:
    """Set ``owner.name = new`` and remember the original under ``key``.

    Returns False (and changes nothing) when ``owner.name`` was already patched under ``key``.
    Raises PatchPointMissing when ``owner`` has no attribute ``name`` (unless ``allow_missing``).
    """
    with _lock:
        for rec in _records:
            if rec.key == key and rec.owner is owner and rec.name == name:
                return False
        original = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        if original is _MISSING and not hasattr(owner, name) and not allow_missing:
            owner_name = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
            raise PatchPointMissing(
                f"dsa_plugins patch {key!r}: expected attribute {name!r} on {owner_name}, which is missing; "
                "the framework version moved this patch point. Please report it with your framework version."
            )
        try:
            setattr(new, _MARKER, key)
        except (AttributeError, TypeError):
            pass  # builtins / bound methods cannot carry the marker; the record is authoritative
        setattr(owner, name, new)
        _records.append(_Record(key, owner, name, original))
        return True


def is_patched(owner: Any, name: str, key: str | None = None) -> bool:
    """True when ``owner.name`` is currently patched (optionally: under ``key``)."""
    with _lock:
        return any(r.owner is owner and r.name == name and (key is None or r.key == key) for r in _records)


def applied_keys() -> list[str]:
    """Keys of the patches currently applied, in application order, without repeats."""
    with _lock:
        return list(dict.fromkeys(r.key for r in _records))


def revert_patches(key: str | None = None, *, prefix: bool = False) -> int:
    """Restore originals for ``key`` (all patches when None; every key starting with ``key`` when
    ``prefix``), newest first. Returns how many attributes were restored."""
    with _lock:
        keep, undo = [], []
        for rec in _records:
            match = key is None or rec.key == key or (prefix and rec.key.startswith(key))
            (undo if match else keep).append(rec)
        for rec in reversed(undo):
            if rec.original is _MISSING:
                try:
                    delattr(rec.owner, rec.name)
                except AttributeError:
                    pass
            else:
                setattr(rec.owner, rec.name, rec.original)
        _records[:] = keep
        return len(undo)


def installed_version(package: str) -> Version | None:
    """Version of an installed distribution, or None when it is not installed."""
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def require_version(package: str, minimum: str, below: str | None = None) -> Version:
    """Raise UnsupportedVersion unless ``minimum <= version(package) < below``."""
    version = installed_version(package)
    if version is None:
        raise UnsupportedVersion(f"dsa_plugins needs {package} >= {minimum}, which is not installed")
    if version < Version(minimum) or (below is not None and version >= Version(below)):
        upper = f" and < {below}" if below else ""
        raise UnsupportedVersion(
            f"dsa_plugins patches for {package} support versions >= {minimum}{upper}; found {version}"
        )
    return version
