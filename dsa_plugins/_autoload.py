"""Zero-code-change activation: the ``torch.backends`` entry point.

torch imports every entry point of the group ``torch.backends`` at the end of ``import torch``
and calls it. :func:`autoload` is ours. It only arranges, through post-import hooks
(:mod:`dsa_plugins.patches.import_hooks`), for the adapters of the ``dsa_plugins.adapters`` entry
point group to be registered when their framework finishes importing (``transformers``,
``megatron.core``); it imports neither framework, never raises (a failure is logged once), and
costs well under a millisecond. ``DSA_PLUGINS_AUTOLOAD=0`` turns it off.

This module must stay light: it imports nothing from torch, and from dsa_plugins only the
standard-library-only hook module, at module level.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from dsa_plugins.patches.import_hooks import log_once, pending_hooks, when_imported

logger = logging.getLogger("dsa_plugins")

ENV_DISABLE = "DSA_PLUGINS_AUTOLOAD"
TRIGGERS = ("transformers", "megatron.core")

_lock = threading.Lock()
_autoloaded = False

__all__ = ["TRIGGERS", "autoload", "pending_hooks", "when_imported"]


def _on_framework(trigger: str) -> Callable:
    def hook(_module) -> None:
        from dsa_plugins.adapters import discover_adapters

        for adapter in discover_adapters().values():
            if adapter.trigger != trigger:
                continue
            try:
                adapter.register()
            except Exception as exc:
                log_once(
                    f"adapter:{adapter.name}",
                    "dsa_plugins: the %s adapter did not register: %s: %s",
                    adapter.name,
                    type(exc).__name__,
                    exc,
                )

    hook.__qualname__ = f"autoload[{trigger}]"
    return hook


def autoload() -> None:
    """Entry point of group ``torch.backends``: install the framework hooks. Never raises."""
    global _autoloaded
    try:
        if os.environ.get(ENV_DISABLE, "1").strip().lower() in ("0", "false", "no", "off"):
            return
        with _lock:
            if _autoloaded:
                return
            _autoloaded = True
        for trigger in TRIGGERS:
            when_imported(trigger, _on_framework(trigger))
    except Exception as exc:  # pragma: no cover - defensive: never break `import torch`
        log_once("autoload", "dsa_plugins: autoload failed: %s: %s", type(exc).__name__, exc)
