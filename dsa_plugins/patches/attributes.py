"""Idempotent, reversible monkey-patching with loud failures when a patch point moved.

Every patch is recorded under a *key* (for example ``"hf.glm_moe_dsa"``): applying the same key
twice is a no-op, and ``revert_patches(key)`` restores the originals in reverse order. A patched
object carries the marker attribute ``__dsa_plugins_patch__`` so a second call can tell.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

_MARKER = "__dsa_plugins_patch__"
_MISSING = object()


class PatchPointMissing(RuntimeError):
    """The attribute a patch expects is not where it should be (the framework moved it)."""


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


def class_in(module: Any, name: str) -> type:
    """``module.name``, a class a patch targets; PatchPointMissing when the module has none."""
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise PatchPointMissing(
            f"dsa_plugins: expected class {name} in {getattr(module, '__name__', module)}; "
            "this framework version moved it"
        )
    return cls


def own_attributes(cls: type, *names: str) -> tuple[Any, ...]:
    """The attributes ``names`` as ``cls`` itself defines them (not inherited), checked all at once
    before anything is patched, so a moved patch point never leaves a class half patched."""
    missing = [n for n in names if n not in cls.__dict__]
    if missing:
        raise PatchPointMissing(
            f"dsa_plugins: expected {', '.join(f'{cls.__qualname__}.{n}' for n in missing)} in {cls.__module__}; "
            "this framework version moved it"
        )
    return tuple(cls.__dict__[n] for n in names)


def original_attribute(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before dsa_plugins patched it (KeyError when it is not patched)."""
    with _lock:
        for rec in _records:
            if rec.owner is owner and rec.name == name:
                return rec.original
    raise KeyError(f"{getattr(owner, '__qualname__', owner)}.{name} is not patched by dsa_plugins")
