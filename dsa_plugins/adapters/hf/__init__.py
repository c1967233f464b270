"""Hugging Face Transformers adapter: ``attn_implementation="dsa_tilelang"``.

Where things live:

* :mod:`.models`: the table of supported model types and what each gets (one module per family:
  ``models/v32_family.py`` for GLM-5 / DeepSeek-V3.2 and kin, ``models/deepseek_v4.py``,
  ``models/glm5_next.py``);
* :mod:`.attention`: the attention function (absorbed sparse MLA, per-model handlers, SDPA
  fallback); :mod:`.indexer`: top-k through the fused indexer op; :mod:`.masks`: the lazy mask;
  :mod:`.cache`: the static cache keeps the MLA latent in one buffer (no copy per decode step), and holds
  the fp8 index keys; :mod:`.index_keys`: the opt-in fp8 index cache; :mod:`.indexer_loss`: the opt-in
  indexer KL loss for fine-tuning;
* :mod:`.interfaces`: registration with transformers' attention and mask interfaces;
* :mod:`.tiny`: tiny random configs of every supported model (tests, demo).

``register()`` makes the name valid and routes every supported DSA model through the sparse ops.
It is idempotent and works before or after transformers (or a modeling module) is imported: each
patch is applied by a post-import hook once its module has finished importing, or at once when it
already has. ``unregister()`` reverts everything. The entry point ``dsa_plugins.adapters:
transformers`` exposes ``ADAPTER`` so that ``import torch`` (through ``dsa_plugins._autoload``)
registers it with no code change. This module stays light: the adapter's modules are imported by
``register()``.
"""

from __future__ import annotations

import threading

from ...patches.import_hooks import when_imported
from .. import Adapter
from .constants import ATTN_NAME, PATCH_KEY

_lock = threading.RLock()
_active = False


def _guarded(fn):
    def hook(module):
        if _active:
            fn(module)

    hook.__qualname__ = f"dsa_plugins.hf[{getattr(fn, '__qualname__', fn)}]"
    return hook


def available_models() -> list[str]:
    """Supported DSA model types that the installed transformers ships."""
    from .models import available_models as _available

    return _available()


def register() -> None:
    """Register "dsa_tilelang" with transformers and patch the DSA models (idempotent).

    Raises UnsupportedVersion when the installed transformers is outside the supported range.
    """
    global _active
    from . import interfaces
    from .cache import patch_cache_utils
    from .masks import patch_sliding_mask_function
    from .models import MODELS

    interfaces.check_version()
    with _lock:
        _active = True
        when_imported("transformers.modeling_utils", _guarded(interfaces.register_attention))
        when_imported("transformers.masking_utils", _guarded(interfaces.register_mask))
        when_imported("transformers.masking_utils", _guarded(patch_sliding_mask_function))
        when_imported("transformers.cache_utils", _guarded(patch_cache_utils))
        for model_type in available_models():
            entry = MODELS[model_type]
            when_imported(entry.module, _guarded(entry.patch))


def unregister() -> int:
    """Revert every patch and remove "dsa_tilelang" from transformers' interfaces. Returns how many
    attributes were restored."""
    global _active
    import sys

    from ...patches.attributes import revert_patches

    with _lock:
        _active = False
        if f"{__name__}.interfaces" not in sys.modules:  # nothing was ever registered
            return 0
        from .attention import clear_handlers
        from .interfaces import unregister_interfaces

        clear_handlers()
        unregister_interfaces()
        return revert_patches(f"{PATCH_KEY}.", prefix=True)


def is_registered() -> bool:
    return _active


ADAPTER = Adapter(
    name="transformers",
    trigger="transformers",
    register=register,
    unregister=unregister,
    is_registered=is_registered,
)

__all__ = ["ADAPTER", "ATTN_NAME", "available_models", "is_registered", "register", "unregister"]
