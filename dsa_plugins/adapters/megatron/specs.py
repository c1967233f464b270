"""Module specs that build dsa_plugins' DSA modules through Megatron-core's spec machinery."""

from __future__ import annotations

import copy
from typing import Optional

from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from .attention import AbsorbedMLASelfAttention, DSAttention, TopkCarrier
from .indexer import DSAIndexer
from .layers import DuplicatedLinear, norm_with_eps

# How each model lays out its indexer (see indexer.py). "megatron" reproduces megatron-core 0.16's
# DSAIndexer (rotary dims last, Hadamard on), for checkpoints trained with it.
MODEL_PRESETS: dict[str, dict] = {
    "deepseek_v32": dict(rope_layout="pe_first", rope_interleaved=False, hadamard=False),
    "glm5": dict(rope_layout="pe_first", rope_interleaved=True, hadamard=False),
    "megatron": dict(rope_layout="nope_first", rope_interleaved=True, hadamard=True),
}
# eps of q_a_layernorm / kv_a_layernorm in the released models (HF builds them with the RMSNorm
# default 1e-6, also where rms_norm_eps is 1e-5 as in GLM-5); None: config.layernorm_epsilon.
QK_NORM_EPS: dict[str, Optional[float]] = {"deepseek_v32": 1e-6, "glm5": 1e-6, "megatron": None}
DEFAULT_MODEL = "deepseek_v32"


def preset_name(config, model: Optional[str] = None) -> str:
    """``model``, else ``config.dsa_model``, else DeepSeek-V3.2; aliases accepted."""
    name = model or getattr(config, "dsa_model", None) or DEFAULT_MODEL
    name = {"glm_moe_dsa": "glm5", "glm-5": "glm5", "deepseek-v3.2": "deepseek_v32"}.get(name, name)
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown DSA model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return name


def indexer_params(config, model: Optional[str] = None, **overrides) -> dict:
    """Indexer spec params for the preset (see :func:`preset_name`) with ``overrides``."""
    name = preset_name(config, model)
    params = dict(MODEL_PRESETS[name])
    if name == "megatron":  # megatron's k_norm takes the model's layernorm epsilon
        params["k_norm_eps"] = config.layernorm_epsilon
    params.update({k: v for k, v in overrides.items() if v is not None})
    return params


def default_backend(config) -> BackendSpecProvider:
    """Transformer Engine's provider when ``config.transformer_impl`` asks for it and TE is
    importable, else megatron's local provider."""
    if getattr(config, "transformer_impl", "transformer_engine") == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

            return TESpecProvider()
        except ImportError:
            pass
    return LocalSpecProvider()


def _linear(backend, duplicated: bool):
    fn = getattr(backend, "linear", None)
    if fn is not None:
        return fn()
    return DuplicatedLinear if duplicated else ColumnParallelLinear


def get_dsa_module_spec(
    config,
    backend: Optional[BackendSpecProvider] = None,
    model: Optional[str] = None,
    kernel_backend: Optional[str] = None,
    qk_norm_eps: Optional[float] = None,
    share_topk: bool = False,
    topk_carrier=None,
    **indexer_overrides,
) -> ModuleSpec:
    """Self-attention spec: :class:`AbsorbedMLASelfAttention` + :class:`DSAttention` +
    :class:`DSAIndexer`, with megatron's submodule names (checkpoints of megatron's DSA load).

    ``model``: indexer layout preset ("deepseek_v32", "glm5", "megatron"); ``kernel_backend``:
    "auto" | "tilelang" | "torch" for the ops (None: ``DSA_PLUGINS_BACKEND``); ``qk_norm_eps``: eps
    of q_layernorm / kv_layernorm (default: the preset's, see ``QK_NORM_EPS``); indexer overrides:
    ``rope_layout``, ``rope_interleaved``, ``hadamard``, ``k_norm_eps``. ``share_topk``: no indexer,
    reuse the top-k of the closest earlier layer through ``topk_carrier`` (GLM-5 "shared" layers)."""
    if not config.multi_latent_attention:
        raise ValueError("DSA needs multi-latent attention (config.multi_latent_attention=True)")
    if getattr(config, "qk_l2_norm", False):
        raise ValueError("qk_l2_norm is not supported with MLA")
    backend = backend or default_backend(config)
    rms_norm = config.normalization == "RMSNorm"
    # The indexer needs the normalised query latent, so q/kv norms stay separate modules.
    qk_norm = backend.layer_norm(rms_norm=rms_norm, for_qk=True) if config.qk_layernorm else IdentityOp
    if qk_norm_eps is None:
        qk_norm_eps = QK_NORM_EPS[preset_name(config, model)]
    if qk_norm is not IdentityOp and qk_norm_eps is not None and qk_norm_eps != config.layernorm_epsilon:
        qk_norm = norm_with_eps(qk_norm, qk_norm_eps)
    indexer = ModuleSpec(
        module=DSAIndexer,
        params=indexer_params(config, model, **indexer_overrides),
        submodules=DSAIndexerSubmodules(
            linear_wq_b=_linear(backend, True),
            linear_wk=_linear(backend, True),
            k_norm=backend.layer_norm(rms_norm=False, for_qk=True),
            linear_weights_proj=_linear(backend, True),
        ),
    )
    core_params = {"backend": kernel_backend} if kernel_backend else {}
    if topk_carrier is not None:
        core_params["topk_carrier"] = topk_carrier
    core_attention = ModuleSpec(
        module=DSAttention,
        params=core_params,
        submodules=DSAttentionSubmodules(indexer=None if share_topk else indexer),
    )
    return ModuleSpec(
        module=AbsorbedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=_linear(backend, False),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=_linear(backend, False),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=core_attention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            kv_layernorm=qk_norm,
        ),
        metainfo={"fuse_input_layernorm": False},
    )


def _use_te(config, use_transformer_engine: Optional[bool]) -> bool:
    if use_transformer_engine is not None:
        return use_transformer_engine
    return not isinstance(default_backend(config), LocalSpecProvider)


def _swap_attention(layer_spec: ModuleSpec, attention: ModuleSpec, backend, config) -> ModuleSpec:
    layer_spec = copy.copy(layer_spec)
    subs = copy.copy(layer_spec.submodules)
    subs.self_attention = attention
    if subs.input_layernorm is IdentityOp:  # the attention does not fuse the input norm
        subs.input_layernorm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=False)
    layer_spec.submodules = subs
    return layer_spec


def get_dsa_layer_spec(
    config,
    num_experts: Optional[int] = None,
    use_transformer_engine: Optional[bool] = None,
    model: Optional[str] = None,
    kernel_backend: Optional[str] = None,
    **indexer_overrides,
) -> ModuleSpec:
    """A ``TransformerLayer`` spec: megatron's GPT layer (MLA, dense MLP or MoE with
    ``num_experts``) whose self-attention is dsa_plugins' DSA."""
    from megatron.core.models.gpt import gpt_layer_specs as g

    te = _use_te(config, use_transformer_engine)
    common = dict(
        num_experts=num_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=True,
    )
    if te:
        base = g.get_gpt_layer_with_transformer_engine_spec(**common)
    else:
        base = g.get_gpt_layer_local_spec(normalization=config.normalization, **common)
    backend = default_backend(config) if te else LocalSpecProvider()
    attention = get_dsa_module_spec(config, backend, model=model, kernel_backend=kernel_backend, **indexer_overrides)
    return _swap_attention(base, attention, backend, config)


def get_dsa_decoder_block_spec(
    config,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
    model: Optional[str] = None,
    kernel_backend: Optional[str] = None,
    indexer_types: Optional[list] = None,
    **indexer_overrides,
):
    """A ``TransformerBlockSubmodules`` like megatron's ``get_gpt_decoder_block_spec`` (dense/MoE
    pattern from ``config.moe_layer_freq``, pipeline slicing) with DSA self-attention everywhere.

    ``indexer_types`` (else ``config.dsa_indexer_types``): per layer "full" (own indexer) or
    "shared" (GLM-5 cross-layer top-k sharing: HF ``config.indexer_types``)."""
    from megatron.core.models.gpt import gpt_layer_specs as g
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    te = _use_te(config, use_transformer_engine)
    block = g.get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage, pp_rank=pp_rank
    )
    backend = default_backend(config) if te else LocalSpecProvider()
    kinds = indexer_types if indexer_types is not None else getattr(config, "dsa_indexer_types", None)
    kw = dict(model=model, kernel_backend=kernel_backend, **indexer_overrides)
    block = copy.copy(block)
    if not kinds or all(k == "full" for k in kinds):
        attention = get_dsa_module_spec(config, backend, **kw)
        block.layer_specs = [_swap_attention(spec, attention, backend, config) for spec in block.layer_specs]
        return block
    if len(kinds) != config.num_layers or set(kinds) - {"full", "shared"}:
        raise ValueError(f"indexer_types must list 'full' / 'shared' for each of {config.num_layers} layers")
    if config.pipeline_model_parallel_layout is not None:
        raise NotImplementedError("shared top-k layers with a custom pipeline layout are not supported")
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    assert len(block.layer_specs) == get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if kinds[offset] == "shared":
        raise NotImplementedError(f"layer {offset} shares top-k from an earlier pipeline stage")
    carrier = TopkCarrier()
    specs = {
        kind: get_dsa_module_spec(config, backend, share_topk=kind == "shared", topk_carrier=carrier, **kw)
        for kind in ("full", "shared")
    }
    block.layer_specs = [
        _swap_attention(spec, specs[kinds[offset + i]], backend, config) for i, spec in enumerate(block.layer_specs)
    ]
    return block
