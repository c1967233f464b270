"""Shortcut to the Hugging Face adapter.

    import dsa_plugins.hf
    dsa_plugins.hf.register()          # "dsa_tilelang" becomes a valid attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dsa_tilelang")
    # or, on a model already built: model.set_attn_implementation("dsa_tilelang")
    dsa_plugins.hf.unregister()        # reverts every patch

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

ATTN_IMPLEMENTATION = "dsa_tilelang"

__all__ = ["ADAPTER", "ATTN_IMPLEMENTATION", "available_models", "is_registered", "register", "unregister"]
