"""DeepSeek-V4 (sliding window + compressed sparse / heavily compressed attention, per-head sinks)
through dsa_plugins' sparse attention, trained for a few steps and compared with eager, then generating with
the package's fixed-size cache (what ``cache_implementation="static"`` makes for V4 under dsa_tilelang; on a GPU
transformers compiles the step and replays it as a CUDA graph).

A tiny random-weight model; the same code runs a real checkpoint on a GPU in bf16.
"""

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

import dsa_plugins.hf

dsa_plugins.hf.register()

config = DeepseekV4Config(
    vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4, o_groups=2, o_lora_rank=16,
    index_n_heads=16, index_head_dim=16, index_topk=2, sliding_window=4, partial_rotary_factor=0.25,
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=None,
)
losses = {}
for impl in ("eager", "dsa_tilelang"):
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM._from_config(config, attn_implementation=impl)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    losses[impl] = []
    for _ in range(4):
        loss = model(data, labels=data, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[impl].append(loss.item())
for step, (a, b) in enumerate(zip(losses["eager"], losses["dsa_tilelang"])):
    print(f"step {step}: eager {a:.6f}  dsa_tilelang {b:.6f}")
assert all(abs(a - b) < 1e-4 for a, b in zip(losses["eager"], losses["dsa_tilelang"]))

# generation: greedy tokens with the fixed-size cache equal eager's with transformers' dynamic cache
prompt = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(2))
tokens = {}
for impl, extra in (("eager", {}), ("dsa_tilelang", {"cache_implementation": "static"})):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        tokens[impl] = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=2, **extra)
print("generated:", tokens["dsa_tilelang"][:, prompt.shape[1]:].tolist())
assert torch.equal(tokens["dsa_tilelang"], tokens["eager"])
