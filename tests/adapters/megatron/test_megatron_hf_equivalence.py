"""A tiny random HF GLM-5 (glm_moe_dsa) or DeepSeek-V3.2 model converted to Megatron gives HF's
logits (fp32, CPU). The two differ in the indexer RoPE (GLM-5 interleaved, V3.2 half-split)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")

LAYERS, VOCAB, SEQ = 3, 97, 12


MODELS = {"glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
          "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")}
SHARED = ["full", "shared", "full"]  # GLM-5 cross-layer top-k sharing: layer 1 reuses layer 0's


def _hf_model(preset="glm5", shared=False):
    config_cls, model_cls = (getattr(transformers, n, None) for n in MODELS[preset])
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {MODELS[preset][1]}")
    extra = {"indexer_types": SHARED} if shared else {}

    cfg = config_cls(**extra,
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, index_topk=5, index_head_dim=16, index_n_heads=8,
        first_k_dense_replace=1, max_position_embeddings=64, n_group=1, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
        routed_scaling_factor=2.5, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = model_cls(cfg).float().eval()
    with torch.no_grad():  # make router bias, norms and indexer non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * 0.2)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4) * 0.1)
    return model


def _megatron_config(hf_cfg):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=LAYERS, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8,
        rope_type="rope", rotary_base=10000, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
        normalization="RMSNorm", layernorm_epsilon=1e-5, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        num_moe_experts=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
        moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5, moe_router_dtype="fp32", moe_layer_freq=[0, 1, 1],
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none",
        experimental_attention_variant="dsa", dsa_indexer_n_heads=8, dsa_indexer_head_dim=16,
        dsa_indexer_topk=5, dsa_indexer_loss_coeff=0.0, transformer_impl="local",
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
    )


@pytest.mark.parametrize("preset,shared", [("glm5", False), ("glm5", True), ("deepseek_v32", False)])
def test_hf_to_megatron_same_logits(megatron_env, tmp_path, preset, shared):
    from megatron.core.models.gpt import GPTModel
    from safetensors.torch import load_file

    from dsa_plugins.convert import main as convert_main
    from dsa_plugins.megatron import get_dsa_decoder_block_spec

    hf = _hf_model(preset, shared)
    if shared:
        assert list(hf.config.indexer_types) == SHARED and hf.model.layers[1].self_attn.indexer is None
    hf.save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    assert convert_main(["--to", "megatron", str(tmp_path / "hf"), str(tmp_path / "mg"), "--no-progress"]) == 0

    config = _megatron_config(hf.config)
    model = GPTModel(
        config, get_dsa_decoder_block_spec(
            config, use_transformer_engine=False, model=preset, indexer_types=SHARED if shared else None
        ),
        vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="none",
        share_embeddings_and_output_weights=False,
    ).eval()
    state = {}
    for f in sorted((tmp_path / "mg").glob("*.safetensors")):
        state.update(load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if not k.endswith("_extra_state")], missing

    tok = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = hf(tok).logits
        got = model(tok, torch.arange(SEQ)[None].expand(2, -1), None)
    torch.testing.assert_close(got, expect, rtol=2e-4, atol=2e-4)
