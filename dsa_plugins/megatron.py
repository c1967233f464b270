"""Public shortcuts for Megatron-core.

    from dsa_plugins.megatron import get_dsa_decoder_block_spec
    spec = get_dsa_decoder_block_spec(config, model="glm5")
    model = GPTModel(config, spec, ...)

or, for scripts that already set ``experimental_attention_variant="dsa"`` and call megatron's
``get_transformer_block_with_experimental_attention_variant_spec``: ``dsa_plugins.megatron.register()``
(done automatically on ``import megatron.core`` unless ``DSA_PLUGINS_AUTOLOAD=0``).
"""

from __future__ import annotations

from dsa_plugins.adapters.megatron import is_registered, register, unregister


def get_dsa_layer_spec(config, *args, **kwargs):
    """See :func:`dsa_plugins.adapters.megatron.specs.get_dsa_layer_spec`."""
    from dsa_plugins.adapters.megatron.specs import get_dsa_layer_spec as _impl

    return _impl(config, *args, **kwargs)


def get_dsa_decoder_block_spec(config, *args, **kwargs):
    """See :func:`dsa_plugins.adapters.megatron.specs.get_dsa_decoder_block_spec`."""
    from dsa_plugins.adapters.megatron.specs import get_dsa_decoder_block_spec as _impl

    return _impl(config, *args, **kwargs)


def get_dsa_module_spec(config, *args, **kwargs):
    """See :func:`dsa_plugins.adapters.megatron.specs.get_dsa_module_spec`."""
    from dsa_plugins.adapters.megatron.specs import get_dsa_module_spec as _impl

    return _impl(config, *args, **kwargs)


__all__ = [
    "get_dsa_layer_spec",
    "get_dsa_decoder_block_spec",
    "get_dsa_module_spec",
    "register",
    "unregister",
    "is_registered",
]
