"""Post-import hooks: run a callback once a module has *finished* importing.

:func:`when_imported` calls ``hook(module)`` once ``name`` has finished executing (at once when it
already has). A hook that patches a modeling module therefore never sees a partially initialised
module (the "circular import" AttributeError), and no hook needs to import another framework
module itself. A failing hook is logged once and never breaks the user's import.

Why not ``wrapt.register_post_import_hook``: importing wrapt costs about 60 ms, far above the
budget of the ``torch.backends`` entry point that installs these hooks inside every
``import torch``; the finder below does the same job for the handful of module names we watch with
the standard ``importlib`` protocol. This module imports only the standard library.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable

logger = logging.getLogger("dsa_plugins")

_lock = threading.RLock()
_hooks: dict[str, list[Callable]] = {}
_deferred: dict[str, list[Callable]] = {}  # modules in sys.modules but still executing
_finder: _PostImportFinder | None = None
_logged: set[str] = set()


def log_once(key: str, msg: str, *args) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(msg, *args)


def _run(name: str, hook: Callable, module) -> None:
    try:
        hook(module)
    except Exception as exc:  # a hook must never break the user's import
        log_once(
            f"hook:{name}:{getattr(hook, '__qualname__', hook)}",
            "dsa_plugins: post-import hook for %s failed: %s: %s",
            name,
            type(exc).__name__,
            exc,
        )


class _LoaderWithHooks:
    """Delegates to the real loader, then runs the hooks once the module has executed."""

    def __init__(self, loader, name: str):
        self._dsa_loader = loader
        self._dsa_name = name

    def __getattr__(self, attr):
        return getattr(self._dsa_loader, attr)

    def create_module(self, spec):
        create = getattr(self._dsa_loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        loader = self._dsa_loader
        # Leave no trace of the wrapper on the module (inspect, linecache, resources use __loader__).
        try:
            module.__loader__ = loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = loader
        except Exception:
            pass
        loader.exec_module(module)
        _fire(self._dsa_name, sys.modules.get(self._dsa_name, module))


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loader of watched module names; it finds nothing itself."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if _deferred:
            _sweep()
        if fullname not in _hooks:
            return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _LoaderWithHooks(spec.loader, fullname)
        return spec


def _fire(name: str, module) -> None:
    with _lock:
        hooks = _hooks.pop(name, [])
    for hook in hooks:
        _run(name, hook, module)


def _sweep() -> None:
    """Fire the hooks of deferred modules that have finished executing since."""
    ready = []
    with _lock:
        for name in list(_deferred):
            module = sys.modules.get(name)
            if module is None:  # its import failed: wait for the next attempt
                _hooks.setdefault(name, []).extend(_deferred.pop(name))
            elif not _is_initialising(module):
                ready.append((name, module, _deferred.pop(name)))
    for name, module, hooks in ready:
        for hook in hooks:
            _run(name, hook, module)


def when_imported(name: str, hook: Callable) -> None:
    """Call ``hook(module)`` once ``name`` has finished importing (now, if it already has).

    A module that is still executing (the hook was asked for from inside its import chain) gets
    its hooks at the first import anywhere after it has finished.
    """
    global _finder
    module = sys.modules.get(name)
    if module is not None and not _is_initialising(module):
        _run(name, hook, module)
        return
    with _lock:
        (_deferred if module is not None else _hooks).setdefault(name, []).append(hook)
        if _finder is None or _finder not in sys.meta_path:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)


def is_imported(name: str) -> bool:
    """True when module ``name`` is in ``sys.modules`` and has finished executing."""
    module = sys.modules.get(name)
    return module is not None and not _is_initialising(module)


def _is_initialising(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def pending_hooks() -> dict[str, int]:
    """Module names still watched, with their number of hooks (for tests and debugging)."""
    with _lock:
        out = {name: len(hooks) for name, hooks in _hooks.items()}
        for name, hooks in _deferred.items():
            out[name] = out.get(name, 0) + len(hooks)
        return out
