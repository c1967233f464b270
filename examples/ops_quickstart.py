"""The public ops on random inputs: runs as written, on a Hopper GPU (TileLang kernels, bf16) or
on the CPU (torch reference). `python examples/ops_quickstart.py`"""

import torch

import dsa_plugins
from dsa_plugins import ops

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
small = device == "cpu"
T, H, Hi, Di = (256, 16, 8, 64) if small else (4096, 64, 32, 128)
KV_LORA, ROPE, V_HEAD, TOPK = (128, 32, 64, 64) if small else (512, 64, 256, 2048)

# --- lightning indexer + top-k over two packed sequences (THD), causal within each --------------
cu_seqlens = torch.tensor([0, T // 4, T], device=device, dtype=torch.int32)
index_q = torch.randn(T, Hi, Di, device=device, dtype=dtype)
index_k = torch.randn(T, Di, device=device, dtype=dtype)
weights = torch.randn(T, Hi, device=device) * (Hi * Di) ** -0.5
topk = dsa_plugins.tilelang_indexer_topk(index_q, index_k, weights, cu_seqlens, TOPK)  # [T, 1, k]
print("top-k indices", tuple(topk.shape), "rows with -1 padding:", int((topk == -1).any(-1).sum()))

# --- absorbed sparse MLA on the selected keys (GLM-5 / DeepSeek-V3.2 style) ----------------------
q = torch.randn(T, H, KV_LORA + ROPE, device=device, dtype=dtype, requires_grad=True)
kv_latent = torch.randn(T, 1, KV_LORA + ROPE, device=device, dtype=dtype, requires_grad=True)
w_vc = (torch.randn(H, V_HEAD, KV_LORA, device=device) * KV_LORA ** -0.5).to(dtype).requires_grad_()
scale = (128 + 64) ** -0.5  # the model's softmax scale, e.g. 1/sqrt(qk_nope + qk_rope)
out = dsa_plugins.tilelang_sparse_attention(q, kv_latent, topk, w_vc, scale)
out.float().square().mean().backward()
print("sparse MLA out", tuple(out.shape), "grad norms", [round(t.grad.float().norm().item(), 3) for t in (q, kv_latent, w_vc)])

# --- DeepSeek-V4 style: per-head sink, Dqk = Dv ------------------------------------------------------
B, S, D = 1, T // 2, 512 if not small else 64
qv4 = torch.randn(B, S, H, D, device=device, dtype=dtype)
kv4 = torch.randn(B, S, D, device=device, dtype=dtype)
sink = torch.zeros(H, device=device)
idx = torch.randint(-1, S, (B, S, TOPK // 2), device=device, dtype=torch.int32)
o4 = dsa_plugins.sparse_attn_tilelang(qv4, kv4, sink, idx)
print("V4 sparse attention out", tuple(o4.shape), "finite:", bool(torch.isfinite(o4.float()).all()))

# --- the indexer's KL loss (sparse stage): gradients reach the indexer only --------------------------
index_q.requires_grad_()
loss = ops.indexer_kl_loss(index_q, index_k, weights, q.detach(), kv_latent.detach(), None, scale, topk_indices=topk)
loss.backward()
print(f"indexer KL loss {loss.item():.4f}; d index_q norm {index_q.grad.float().norm().item():.4f}")
