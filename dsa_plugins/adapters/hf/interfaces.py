"""Registration of ``dsa_tilelang`` with transformers' two interfaces: ``AttentionInterface``
(the attention function, :func:`~.attention.dsa_attention_forward`) and
``AttentionMaskInterface`` (the mask, :func:`~.masks.dsa_mask`; without it the V3.2 family fails
on ``attention_mask[:, 0]``). Both must be registered before ``from_pretrained`` validates the
name. Idempotent; :func:`unregister_interfaces` restores what was there before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ...patches.attributes import PatchPointMissing
from ...patches.versions import require_version
from .attention import dsa_attention_forward
from .constants import ATTN_NAME, SUPPORTED_TRANSFORMERS
from .masks import dsa_mask

__all__ = ["check_version", "interfaces_registered", "register_attention", "register_mask", "unregister_interfaces"]

_lock = threading.RLock()
_MISSING = object()
_saved_interfaces: dict[str, Any] = {}


def check_version() -> None:
    """Raise UnsupportedVersion unless transformers is in the tested range."""
    require_version("transformers", *SUPPORTED_TRANSFORMERS)


def register_attention(modeling_utils=None) -> None:
    """Add "dsa_tilelang" to transformers' AttentionInterface (module: transformers.modeling_utils)."""
    _register_in(_interface(modeling_utils, "modeling_utils", "AttentionInterface"), "attention",
                 dsa_attention_forward)


def register_mask(masking_utils=None) -> None:
    """Add "dsa_tilelang" to transformers' AttentionMaskInterface (module: transformers.masking_utils)."""
    _register_in(_interface(masking_utils, "masking_utils", "AttentionMaskInterface"), "mask", dsa_mask)


def _interface(module, module_name: str, class_name: str):
    if module is None:
        import importlib

        module = importlib.import_module(f"transformers.{module_name}")
    interface = getattr(module, class_name, None)
    if interface is None or not hasattr(interface, "_global_mapping"):
        raise PatchPointMissing(f"dsa_plugins: transformers.{module_name}.{class_name}._global_mapping moved")
    return interface


def _register_in(interface, what: str, fn: Callable) -> None:
    with _lock:
        mapping = interface._global_mapping
        if mapping.get(ATTN_NAME) is fn:
            return
        if what not in _saved_interfaces:
            _saved_interfaces[what] = (interface, mapping.get(ATTN_NAME, _MISSING))
        interface.register(ATTN_NAME, fn)


def unregister_interfaces() -> None:
    """Remove "dsa_tilelang" from both interfaces (restoring what was there before, if anything)."""
    with _lock:
        for what, (interface, previous) in list(_saved_interfaces.items()):
            if previous is _MISSING:
                interface._global_mapping.pop(ATTN_NAME, None)
            else:
                interface._global_mapping[ATTN_NAME] = previous
        _saved_interfaces.clear()


def interfaces_registered() -> bool:
    """True when "dsa_tilelang" is in both interfaces."""
    return {"attention", "mask"} <= set(_saved_interfaces)
