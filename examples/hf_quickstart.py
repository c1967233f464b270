"""Hugging Face Transformers with DeepSeek Sparse Attention from dsa_plugins, in three steps.

With dsa_plugins installed, ``import torch`` registers the adapter through an entry point, so
``attn_implementation="dsa_tilelang"`` works with no code change; ``dsa_plugins.hf.register()`` does
the same explicitly (and is a no-op when it already ran). Here: a tiny GLM-5 (glm_moe_dsa) with
random weights, saved and reloaded like a checkpoint from the Hub, then compared with eager.
On a CUDA GPU use dtype=torch.bfloat16 and device_map="auto": the TileLang kernels run.
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

import dsa_plugins.hf

dsa_plugins.hf.register()  # explicit; already done at `import torch` when the package is installed

# 1. a checkpoint (here: tiny, random weights; in real life a path or a Hub id such as zai-org/GLM-5)
config = GlmMoeDsaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
    kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=8, index_head_dim=16, index_n_heads=16, first_k_dense_replace=1, pad_token_id=None,
)
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as path:
    GlmMoeDsaForCausalLM(config).save_pretrained(path)

    # 2. load it with the sparse attention of dsa_plugins (and with eager, to compare)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dsa_tilelang")
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")

# 3. use it as usual: batch with left padding, greedy generation with the KV cache
ids = torch.randint(3, 128, (2, 20))
mask = torch.ones_like(ids)
mask[1, :6] = 0  # left padding
with torch.no_grad():
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
    ref = eager.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=2)
print("generated:", out[:, ids.shape[1]:].tolist())
print("same tokens as eager:", torch.equal(out, ref))
assert torch.equal(out, ref)

# A model that already exists can switch too:
eager.set_attn_implementation("dsa_tilelang")
print("attn_implementation:", eager.config._attn_implementation)
