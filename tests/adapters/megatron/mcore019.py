"""megatron-core 0.19 on CPU for the backend tests: shims, a tiny GLM-5-like DSA GPT model, one step.

Shims (megatron 0.19 without a GPU, Transformer Engine or fast_hadamard_transform):
- ``torch.cuda.current_device`` answers "cpu" (RoPE, the indexer-loss tracker);
- ``LocalSpecProvider`` has no ``linear()`` (the indexer's duplicated linears): a subclass adds it;
- without TE the absorbed MLA accepts only ``ColumnParallelLinear`` down-projections;
- the layer specs are built with the provider (the block-level spec function asserts TE);
- ``dsa_indexer_rotate_activation=False`` (the Hadamard needs fast_hadamard_transform);
- context parallel: ``get_pos_emb_on_this_cp_rank`` moves a pinned index tensor to CUDA: a CPU copy.
"""

from __future__ import annotations

import os

import torch

VOCAB = 128


def apply_cpu_shims() -> None:
    if torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # noqa: E731
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rpe
    import megatron.core.models.common.embeddings.yarn_rotary_pos_embedding as yrpe

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    rpe.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank
    yrpe.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


def init_distributed(rank: int = 0, world: int = 1, cp: int = 1, tp: int = 1, port: int = 29611,
                     dist_backend: str = "gloo") -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if not dist.is_initialized():
        dist.init_process_group(dist_backend, rank=rank, world_size=world)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, 1, context_parallel_size=cp)


TINY = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, q_lora_rank=32, kv_lora_rank=32,
            qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16)
# GLM-5's attention and indexer dims (576/512 latent, 32 x 128 indexer) at 16 heads: what the TileLang
# kernels take (their smallest head count; GLM-5 itself has 64)
GLM5_ATTENTION = dict(hidden_size=1024, num_attention_heads=16, ffn_hidden_size=1024, q_lora_rank=512,
                      kv_lora_rank=512, qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256,
                      dsa_indexer_n_heads=32, dsa_indexer_head_dim=128)


def build(backend: str = "none", loss_coeff: float = 0.1, sparse_loss: bool = True, topk: int = 6,
          cp: int = 1, tp: int = 1, seed: int = 0, num_layers: int = 2, dtype=torch.float32, dims=None,
          device: str = "cpu"):
    """(config, GPTModel) with DSA layers; weights drawn from ``seed`` (the same for every backend).
    ``dims``: TINY (default) or GLM5_ATTENTION; ``device="cuda"`` builds on the GPU in ``dtype``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_layer_with_experimental_attention_variant_spec,
    )
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    class Provider(LocalSpecProvider):
        def linear(self):
            return Linear

    extra = dict(context_parallel_size=cp, cp_comm_type="allgather") if cp > 1 else {}
    if tp > 1:
        extra.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    on_gpu = device == "cuda"
    cfg = MLATransformerConfig(
        num_layers=num_layers, **(dims or TINY),
        rope_type="rope", normalization="RMSNorm", qk_layernorm=True, add_bias_linear=False,
        experimental_attention_variant="dsa", dsa_indexer_topk=topk, dsa_indexer_loss_coeff=loss_coeff, dsa_indexer_use_sparse_loss=sparse_loss,
        dsa_indexer_rotate_activation=False, dsa_kernel_backend=backend,
        transformer_impl="local", use_cpu_initialization=not on_gpu, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        **extra,
    )
    provider = Provider()
    layers = get_transformer_layer_with_experimental_attention_variant_spec(config=cfg, backend=provider)
    for spec in layers:
        attn = spec.submodules.self_attention.submodules
        attn.linear_q_down_proj = ColumnParallelLinear
        attn.linear_kv_down_proj = ColumnParallelLinear
    block = TransformerBlockSubmodules(layer_specs=layers, layer_norm=provider.layer_norm(rms_norm=True, for_qk=False))
    torch.manual_seed(seed)
    try:
        model_parallel_cuda_manual_seed(seed)
    except Exception:  # the CUDA RNG tracker is optional on CPU
        pass
    model = GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=VOCAB, max_sequence_length=1 << 17,
                     position_embedding_type="none")
    return cfg, model.to(device=device, dtype=dtype)  # as megatron's Float16Module: every weight in dtype


def batch(b: int = 2, s: int = 16, seed: int = 1, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (b, s), generator=g)
    labels = torch.randint(0, VOCAB, (b, s), generator=g)
    return tokens.to(device), labels.to(device)


def tracker_values():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    values = DSAIndexerLossLoggingHelper.tracker.get("values")
    return None if values is None else values.clone()


def reset_tracker():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper

    DSAIndexerLossLoggingHelper.clean_loss_in_tracker()


def step(model, tokens, labels, position_ids=None, packed_seq_params=None):
    """One forward + backward: (mean LM loss, {name: grad}, indexer-loss tracker values)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    reset_tracker()
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=tokens.device))
    model.train()
    model.zero_grad()
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    loss = model(tokens, position_ids, attention_mask=None, labels=labels, packed_seq_params=packed_seq_params)
    total = loss.float().mean()
    total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total.detach(), grads, tracker_values()
