"""dsa_plugins: fast DeepSeek Sparse Attention for Hugging Face Transformers and Megatron-core.

Public ops live in :mod:`dsa_plugins.ops` (re-exported here); framework adapters in
:mod:`dsa_plugins.hf` and :mod:`dsa_plugins.megatron` (shortcuts to :mod:`dsa_plugins.adapters`).

Layers, each importing only from the ones before it: ``common`` (settings, index convention,
input checks) and ``patches`` (generic patch machinery) -> ``kernels`` (TileLang programs) and
``reference`` (torch oracle and CPU path) -> ``ops`` (public autograd / custom ops) ->
``adapters`` (``hf``, ``megatron``) -> entry points, CLI and ``bench``.

The names are resolved lazily (PEP 562): torch imports ``dsa_plugins._autoload`` at the end of
every ``import torch`` (entry point group ``torch.backends``), which imports this package first,
so this module must not import the ops (and torch) eagerly.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved

__version__ = "0.2.0"

_OPS = (
    "DeepSeekV4SparseAttention",
    "DeepSeekV4SparseAttentionHeadChunked",
    "FusedIndexerLoss",
    "causal_key_windows",
    "deterministic",
    "indexer_kl_loss",
    "indexer_topk",
    "is_dsa_kernel_available",
    "should_use_tilelang",
    "sparse_attention",
    "sparse_attention_head_chunked",
    "sparse_attn_tilelang",
    "sparse_attn_tilelang_head_chunked",
    "sparse_mla",
    "tilelang_indexer_topk",
    "tilelang_sparse_attention",
    "topk_rows",
)
_SUBMODULES = ("ops", "kernels", "reference", "adapters", "patches", "common", "bench", "hf", "megatron")

__all__ = ["__version__", *_OPS]

_moved.install()  # old import paths (0.1) keep working for one release, with a DeprecationWarning

if TYPE_CHECKING:  # pragma: no cover
    from .ops import *  # noqa: F401,F403


def __getattr__(name: str):
    if name in _OPS:
        value = getattr(importlib.import_module(".ops", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dsa_plugins' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_OPS) | set(_SUBMODULES))
