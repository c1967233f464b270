"""Hugging Face Transformers adapter: ``attn_implementation="dsa_tilelang"``.

``register()`` makes the name valid and routes every supported DSA model through dsa_plugins'
sparse ops (see :mod:`dsa_plugins.patches.transformers`). It is idempotent and works before or
after transformers (or a modeling module) is imported: each patch is applied by a post-import
hook once its module has finished importing, or at once when it already has. ``unregister()``
reverts everything. The entry point ``dsa_plugins.adapters: transformers`` exposes ``ADAPTER`` so
that ``import torch`` (through ``dsa_plugins._autoload``) registers it with no code change.
"""

from __future__ import annotations

import importlib.util
import os
import threading

from dsa_plugins._autoload import when_imported
from dsa_plugins.adapters import Adapter

_lock = threading.RLock()
_active = False


def _models_dir() -> str | None:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(next(iter(spec.submodule_search_locations)), "models")


def available_models() -> list[str]:
    """Supported DSA model types that the installed transformers ships."""
    from dsa_plugins.patches.transformers import MODELS

    root = _models_dir()
    return [m for m in MODELS if root is not None and os.path.isdir(os.path.join(root, m))]


def _guarded(fn):
    def hook(module):
        if _active:
            fn(module)

    hook.__qualname__ = f"dsa_plugins.hf[{getattr(fn, '__name__', fn)}]"
    return hook


def register() -> None:
    """Register "dsa_tilelang" with transformers and patch the DSA models (idempotent).

    Raises UnsupportedVersion when the installed transformers is outside the supported range.
    """
    global _active
    from dsa_plugins.patches import transformers as tp

    tp.check_version()
    with _lock:
        _active = True
        when_imported("transformers.modeling_utils", _guarded(tp.register_attention))
        when_imported("transformers.masking_utils", _guarded(tp.register_mask))
        for model_type in available_models():
            name, patch = tp.MODELS[model_type]
            when_imported(name, _guarded(patch))


def unregister() -> None:
    """Revert every patch and remove "dsa_tilelang" from transformers' interfaces."""
    global _active
    with _lock:
        _active = False
        import sys

        if "dsa_plugins.patches.transformers" in sys.modules:
            sys.modules["dsa_plugins.patches.transformers"].unpatch_all()


def is_registered() -> bool:
    return _active


ADAPTER = Adapter(
    name="transformers",
    trigger="transformers",
    register=register,
    unregister=unregister,
    is_registered=is_registered,
)

__all__ = ["ADAPTER", "available_models", "is_registered", "register", "unregister"]
