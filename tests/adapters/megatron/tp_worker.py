"""Run a tiny DSA GPTModel at a tensor-parallel size on CPU (gloo) and save what it computed.

    python tp_worker.py TP OUT_FILE [sp] [cuda]

Spawns TP processes; rank 0 saves logits, per-layer indexer losses, indexer and q/kv-norm
gradients (and checks that every TP rank holds the same indexer gradients: it is replicated).

``cuda``: one GPU per rank with NCCL, bf16 and dims the TileLang kernels take (the kernels run);
otherwise CPU processes with gloo and fp32 (the torch reference runs).

``sp``: sequence parallelism. gloo has no reduce-scatter and megatron's torch norms refuse SP, so
the worker emulates reduce-scatter with all-reduce + slice, uses a torch RMSNorm that marks its
weight ``sequence_parallel``, and all-reduces those gradients over TP as megatron's
``finalize_model_grads`` does.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch


class SPRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm signature; marks its weight sequence-parallel under SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True


def _reduce_scatter(output, input_, op=None, group=None, async_op=False):
    import torch.distributed as dist

    buf = input_.clone()
    dist.all_reduce(buf, group=group)
    output.copy_(buf.chunk(dist.get_world_size(group))[dist.get_rank(group)])
    return _Done() if async_op else None


class _Done:
    """The handle of an already finished collective."""

    def wait(self):
        return None


def _sp_spec(config):
    import copy

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from dsa_plugins.adapters.megatron.layers import norm_with_eps
    from dsa_plugins.megatron import get_dsa_layer_spec

    layer = get_dsa_layer_spec(config, model="glm5")
    subs = copy.copy(layer.submodules)
    subs.input_layernorm = subs.pre_mlp_layernorm = SPRMSNorm
    attn = copy.copy(subs.self_attention)
    attn.submodules = copy.copy(attn.submodules)
    attn.submodules.q_layernorm = attn.submodules.kv_layernorm = norm_with_eps(SPRMSNorm, 1e-6)
    subs.self_attention = attn
    layer = copy.copy(layer)
    layer.submodules = subs
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=SPRMSNorm)


def _worker(rank: int, tp: int, port: int, out_file: str, sp: bool = False, cuda: bool = False) -> None:
    warnings.filterwarnings("ignore")
    os.environ["DSA_PLUGINS_AUTOLOAD"] = "0"
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    if not cuda:
        torch.cuda.current_device = lambda: "cpu"
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from dsa_plugins.megatron import get_dsa_layer_spec

    mla.HAVE_TE = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if sp and not cuda:  # gloo: emulated reduce-scatter, no CUDA RNG tracker
        import megatron.core.tensor_parallel.layers as tp_layers
        import megatron.core.tensor_parallel.mappings as tp_mappings

        tp_mappings.dist_reduce_scatter_func = _reduce_scatter
        tp_layers.dist_reduce_scatter_func = _reduce_scatter
        # SP embeddings fork the CUDA RNG tracker (for dropout, 0 here): no CUDA on this machine
        import contextlib

        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    ps.initialize_model_parallel(tp, 1)
    losses = []
    mdsa.DSAIndexerLossLoggingHelper.save_loss_to_tracker = staticmethod(
        lambda loss, layer_number, num_layers, **kw: losses.append(loss.detach().clone())
    )
    if cuda:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
        dims = dict(hidden_size=256, num_attention_heads=8, ffn_hidden_size=256, q_lora_rank=128, kv_lora_rank=512,
                    qk_head_dim=64, qk_pos_emb_head_dim=64, v_head_dim=64, dsa_indexer_n_heads=16,
                    dsa_indexer_head_dim=64, dsa_indexer_topk=64, params_dtype=torch.bfloat16, bf16=True,
                    init_method_std=0.02,
                    # the master weights are drawn on the CPU and then split, so every TP size starts
                    # from the same weights (GPU initialisation draws each shard with its own RNG)
                    use_cpu_initialization=True)
        seqlen, vocab = 256, 512
    else:
        dims = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
                    q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8,
                    dsa_indexer_n_heads=8, dsa_indexer_head_dim=16, dsa_indexer_topk=5,
                    params_dtype=torch.float32, init_method_std=0.2)
        seqlen, vocab = 12, 96
    config = MLATransformerConfig(
        num_layers=2, rope_type="rope", normalization="RMSNorm", qk_layernorm=True,
        experimental_attention_variant="dsa", dsa_indexer_loss_coeff=1.0, dsa_indexer_use_sparse_loss=True,
        transformer_impl="local", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=sp and tp > 1, **dims,
    )
    torch.manual_seed(0)
    spec = _sp_spec(config) if sp else get_dsa_layer_spec(config, model="glm5")
    model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seqlen,
                     position_embedding_type="none", parallel_output=False)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:  # bf16 training casts every parameter, as megatron's Float16Module does
        model = model.to(device=device, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, vocab, (2, seqlen), generator=g).to(device)
    logits = model(tok, torch.arange(seqlen, device=device)[None].expand(2, -1), None)
    logits.float().square().mean().backward()
    for p in model.parameters():  # what megatron's finalize_model_grads does for SP norms
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if ".indexer." in n or "layernorm" in n}
    for n, grad in grads.items():  # replicated weights must get the same gradient on every rank
        others = [torch.empty_like(grad) for _ in range(tp)]
        dist.all_gather(others, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
        assert all(torch.equal(o, others[0]) for o in others), f"replicated weight's grad differs across TP ranks: {n}"
    if rank == 0:
        torch.save({"logits": logits.detach().float().cpu(), "losses": [x.float().cpu() for x in losses],
                    "grads": {n: x.float().cpu() for n, x in grads.items()}}, out_file)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    tp, out_file = int(sys.argv[1]), sys.argv[2]
    sp, cuda = "sp" in sys.argv[3:], "cuda" in sys.argv[3:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_worker, args=(tp, port, out_file, sp, cuda), nprocs=tp, join=True)


if __name__ == "__main__":
    main()
