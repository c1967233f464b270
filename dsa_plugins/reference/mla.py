"""Absorbed sparse MLA (DeepSeek-V3.2 / GLM-5): latent sparse attention, then the W_vc projection.

q = cat(q_nope @ W_kc, q_pe) [.., H, kv_lora_rank + rope]; kv_latent [.., Skv, kv_lora_rank + rope];
w_vc [H, v_head_dim, kv_lora_rank]; o[.., h, :] = attn_latent[.., h, :kv_lora_rank] @ w_vc[h].T
"""

from __future__ import annotations

import torch


def project_values(latent_out: torch.Tensor, w_vc: torch.Tensor) -> torch.Tensor:
    """[.., H, kv_lora_rank] x [H, v_head_dim, kv_lora_rank] -> [.., H, v_head_dim]."""
    return torch.einsum("...hc,hvc->...hv", latent_out, w_vc.to(latent_out.dtype))
