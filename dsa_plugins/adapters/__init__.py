"""Framework adapters, discovered through the ``dsa_plugins.adapters`` entry-point group.

An adapter is an :class:`Adapter`: the framework module whose import triggers it, and the
functions that register and unregister it. Third parties add a model or a framework by
publishing an entry point of that group whose object is an ``Adapter``.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("dsa_plugins")

ENTRY_POINT_GROUP = "dsa_plugins.adapters"


@dataclass(frozen=True)
class Adapter:
    """``name``: short id; ``trigger``: module whose import activates it (e.g. "transformers");
    ``register`` / ``unregister``: idempotent callables taking no arguments;
    ``is_registered``: returns whether it is active now."""

    name: str
    trigger: str
    register: Callable[[], None]
    unregister: Callable[[], None]
    is_registered: Callable[[], bool]


def discover_adapters() -> dict[str, Adapter]:
    """Load every adapter of the entry-point group; a broken one is logged and skipped."""
    found: dict[str, Adapter] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            adapter = ep.load()
        except Exception as exc:  # a third-party adapter must not break ours
            logger.warning("dsa_plugins: adapter entry point %r failed to load: %s", ep.name, exc)
            continue
        if not isinstance(adapter, Adapter):
            logger.warning("dsa_plugins: entry point %r is not a dsa_plugins.adapters.Adapter; skipped", ep.name)
            continue
        found[adapter.name] = adapter
    return found
