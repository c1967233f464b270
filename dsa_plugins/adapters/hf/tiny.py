"""Tiny random configs of every supported DSA model (tests, the demo, the benchmark's smoke run).

Small enough to run on two CPU cores in milliseconds, but with ``index_topk`` below the sequence
lengths used, so the sparse selection really matters (the sparse and the dense paths differ).
"""

from __future__ import annotations

import importlib

# model_type -> (config class, causal-LM class or base model class, config kwargs)
_COMMON_MLA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    index_topk=5,
    index_head_dim=16,
    index_n_heads=16,
    max_position_embeddings=512,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
)

SPECS: dict[str, tuple[str, str, dict]] = {
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(_COMMON_MLA, num_hidden_layers=3, first_k_dense_replace=1, indexer_types=["full", "shared", "full"]),
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(_COMMON_MLA, num_hidden_layers=2, first_k_dense_replace=1),
    ),
    "axk2": (
        "AXK2Config",
        "AXK2ForCausalLM",
        dict(_COMMON_MLA, num_hidden_layers=2, n_group=None, topk_group=None, gated_norm_rank=8),
    ),
    "hy_v4": (
        "HYV4Config",
        "HYV4ForCausalLM",
        dict(
            _COMMON_MLA, num_hidden_layers=2, hc_mult=2, learnable_sink_init=0.5, head_dim=24,
            indexer_types=["full", "shared"],
        ),
    ),
    # the text model of Hy V4's vision-language release: hy_v4's attention and indexer, GLM-style interleaved rope
    # from three position axes (mrope sections summing to qk_rope_head_dim / 2)
    "hy_v4_vl": (
        "HYV4VLTextConfig",
        "HYV4VLTextModel",
        dict(
            _COMMON_MLA, num_hidden_layers=2, hc_mult=2, learnable_sink_init=0.5, indexer_types=["full", "shared"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        ),
    ),
    "mistral_large4": (
        "MistralLarge4TextConfig",
        "MistralLarge4TextModel",
        {k: v for k, v in dict(_COMMON_MLA, num_hidden_layers=2, first_k_dense_replace=1).items() if k != "q_lora_rank"},
    ),
    "dots3_note": (
        "Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        dict(
            _COMMON_MLA, num_hidden_layers=3, head_dim=24, sliding_window=4, shared_experts_intermediate_size=32,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
        ),
    ),
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            vocab_size=128,
            hidden_size=64,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            head_dim=32,
            q_lora_rank=32,
            num_experts_per_tok=2,
            n_routed_experts=4,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=16,
            index_head_dim=16,
            index_topk=2,
            sliding_window=4,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            hc_mult=2,
            hc_sinkhorn_iters=3,
            partial_rotary_factor=0.25,
            max_position_embeddings=512,
            pad_token_id=None,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # GLM-5.3 (text): NoPE MLA, k-pool indexer (pools of 2, 2 pools picked, tail appended), a shared
    # top-k layer, a KDA linear-attention layer, hyper-connections
    "glm5_next": (
        "Glm5NextTextConfig",
        "Glm5NextTextModel",
        dict(
            {k: v for k, v in _COMMON_MLA.items() if k not in ("index_topk", "qk_rope_head_dim")},
            qk_rope_head_dim=0,
            index_topk=4,
            index_kpool=2,
            index_n_heads=8,
            num_hidden_layers=4,
            layer_types=["indexed_attention", "indexed_attention", "linear_attention", "indexed_attention"],
            indexer_types=["full", "shared", "full", "full"],
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            linear_head_dim=16,
            linear_num_heads=4,
            hc_mult=2,
            hc_sinkhorn_iters=3,
        ),
    ),
}


def _installed_layer_types(layer_types: list) -> list:
    """``layer_types`` as the installed transformers spells the indexed (DSA) layers: "indexed_attention" (5.24),
    "deepseek_sparse_attention" in earlier releases (5.17's glm5_next refuses the newer name)."""
    from transformers import configuration_utils

    allowed = getattr(configuration_utils, "ALLOWED_ATTN_LAYER_TYPES", None)
    if not allowed or "indexed_attention" in allowed or "deepseek_sparse_attention" not in allowed:
        return layer_types
    return ["deepseek_sparse_attention" if t == "indexed_attention" else t for t in layer_types]


# the released models' attention and indexer head sizes (64 heads; latent 512 + rope 64 and 32 index heads of 128 in
# the V3.2 family, GLM-5's), so that a tiny model runs the GPU kernels
_KERNEL_MLA = dict(num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=128, v_head_dim=128, index_n_heads=32, index_head_dim=128, index_topk=64)
_KERNEL_V4 = dict(num_attention_heads=64, head_dim=512, q_lora_rank=64, o_lora_rank=32, index_n_heads=64,
                  index_head_dim=128, partial_rotary_factor=0.125, sliding_window=64, index_topk=16,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32})


def kernel_sizes(model_type: str) -> dict:
    """``tiny_config`` overrides with the released models' head sizes, which the GPU kernels serve: 576/512 (the
    V3.2 family), 512/512 without rope (glm5_next), D512 with sinks (deepseek_v4)."""
    if model_type == "deepseek_v4":
        return dict(_KERNEL_V4)
    sizes = dict(_KERNEL_MLA)
    if model_type == "glm5_next":
        sizes["qk_rope_head_dim"] = 0
    if "head_dim" in SPECS[model_type][2]:  # the configs that also take the per-head width
        sizes["head_dim"] = sizes["qk_nope_head_dim"] + sizes["qk_rope_head_dim"]
    if model_type == "hy_v4_vl":  # its mrope sections sum to half the rope width
        sizes["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]}
    return sizes


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type`` (random-weight models only)."""
    if model_type not in SPECS:
        raise KeyError(f"no tiny config for {model_type!r}; known: {sorted(SPECS)}")
    import transformers

    config_cls, _, kwargs = SPECS[model_type]
    kwargs = {**kwargs, **overrides}
    if "layer_types" in kwargs:
        kwargs["layer_types"] = _installed_layer_types(list(kwargs["layer_types"]))
    return getattr(transformers, config_cls)(**kwargs)


def model_class(model_type: str):
    import transformers

    return getattr(transformers, SPECS[model_type][1])


def tiny_model(model_type: str, seed: int = 0, attn_implementation: str = "eager", **overrides):
    """A tiny model with random weights (fp32, eval mode)."""
    import torch

    torch.manual_seed(seed)
    config = tiny_config(model_type, **overrides)
    model = model_class(model_type)._from_config(config, attn_implementation=attn_implementation)
    return model.eval()


def is_causal_lm(model_type: str) -> bool:
    return SPECS[model_type][1].endswith("ForCausalLM")


def available(model_type: str) -> bool:
    """Whether the installed transformers has this model type."""
    try:
        importlib.import_module(f"transformers.models.{model_type}")
    except ImportError:
        return False
    return True
