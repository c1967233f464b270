"""Shortcut to the Hugging Face adapter.

    import dsa_plugins.hf
    dsa_plugins.hf.register()          # "dsa_tilelang" becomes a valid attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dsa_tilelang")
    # or, on a model already built: model.set_attn_implementation("dsa_tilelang")
    dsa_plugins.hf.unregister()        # reverts every patch
    handle = dsa_plugins.hf.enable_indexer_loss(model, weight=0.01)   # fine-tuning: train the indexers too
    dsa_plugins.hf.enable_fp8_index_cache(model)   # serving: indexer keys scored and cached in fp8 (opt-in)
    cache = dsa_plugins.hf.DsaV4StaticCache(config, max_cache_len=n)  # DeepSeek-V4's fixed-size cache (what
    # generate(..., cache_implementation="static") makes for V4 under dsa_tilelang)

With the package installed, ``import torch`` already registers it (entry point ``torch.backends``);
``DSA_PLUGINS_AUTOLOAD=0`` turns that off.
"""

from dsa_plugins.adapters.hf import (
    ADAPTER,
    available_models,
    is_registered,
    register,
    unregister,
)
from dsa_plugins.adapters.hf.index_keys import disable_fp8_index_cache, enable_fp8_index_cache
from dsa_plugins.adapters.hf.indexer_loss import IndexerLossHandle, disable_indexer_loss, enable_indexer_loss

ATTN_IMPLEMENTATION = "dsa_tilelang"


def __getattr__(name: str):
    if name == "DsaV4StaticCache":  # imports transformers' cache classes: only when asked for
        from dsa_plugins.adapters.hf.models.deepseek_v4_cache import DsaV4StaticCache

        return DsaV4StaticCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ADAPTER", "ATTN_IMPLEMENTATION", "DsaV4StaticCache", "IndexerLossHandle", "available_models",
           "disable_fp8_index_cache", "disable_indexer_loss", "enable_fp8_index_cache", "enable_indexer_loss",
           "is_registered", "register", "unregister"]
