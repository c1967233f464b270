"""Train a tiny Megatron-core GPT with DeepSeek sparse attention from dsa_plugins.

    python examples/megatron_dsa_train.py                 # CPU or one GPU, a few steps
    python examples/megatron_dsa_train.py --zero-code     # build through megatron's own spec function

Two ways in:
1. explicit: ``dsa_plugins.megatron.get_dsa_decoder_block_spec(config, model="glm5")``;
2. zero code change: a config with ``experimental_attention_variant="dsa"`` and megatron's
   ``get_transformer_block_with_experimental_attention_variant_spec`` (what Megatron-LM's
   gpt_builders.py calls). dsa_plugins patches it on ``import megatron.core`` (unless
   DSA_PLUGINS_AUTOLOAD=0); ``dsa_plugins.megatron.register()`` does the same by hand.

The indexer learns from its KL loss (``dsa_indexer_loss_coeff``), attached to the attention
output through megatron's DSAIndexerLossAutoScaler; the printed "indexer loss" comes from
megatron's DSAIndexerLossLoggingHelper tracker.
"""

import argparse
import socket
import warnings

import torch
import torch.nn.functional as F


def setup(device):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cpu":  # megatron-core on CPU: a few shims (see tests/adapters/megatron/conftest.py)
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.multi_latent_attention as mla

        torch.cuda.current_device = lambda: "cpu"
        mla.HAVE_TE = False
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    with socket.socket() as s:  # a fresh port: an inherited MASTER_PORT may be taken
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    ps.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--zero-code", action="store_true")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    setup(device)

    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossLoggingHelper
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=8,
        q_lora_rank=64, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=16, v_head_dim=16,
        rope_type="rope", normalization="RMSNorm", qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, transformer_impl="local",
        experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=32,
        dsa_indexer_topk=16, dsa_indexer_loss_coeff=0.1, dsa_indexer_use_sparse_loss=True,
        use_cpu_initialization=device.type == "cpu", params_dtype=torch.float32,
    )
    if args.zero_code:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_transformer_block_with_experimental_attention_variant_spec,
        )

        import dsa_plugins.megatron

        dsa_plugins.megatron.register()  # a no-op when autoload did it already
        spec = get_transformer_block_with_experimental_attention_variant_spec(config=config)
    else:
        from dsa_plugins.megatron import get_dsa_decoder_block_spec

        spec = get_dsa_decoder_block_spec(config, use_transformer_engine=False, model="glm5")
    torch.manual_seed(0)
    model = GPTModel(config, spec, vocab_size=256, max_sequence_length=args.seq,
                     position_embedding_type="none").to(device)
    print(type(model.decoder.layers[0].self_attention).__name__, "/",
          type(model.decoder.layers[0].self_attention.core_attention).__name__)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (8, args.seq + 1), generator=g).to(device)
    pos = torch.arange(args.seq, device=device)[None].expand(8, -1)
    for step in range(args.steps):
        loss = model(data[:, :-1], pos, None, labels=data[:, 1:]).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker = DSAIndexerLossLoggingHelper.tracker
        idx_loss = tracker["values"].sum().item() / config.num_layers if "values" in tracker else float("nan")
        DSAIndexerLossLoggingHelper.clean_loss_in_tracker()
        print(f"step {step:3d}  lm loss {loss.item():.4f}  indexer loss {idx_loss:.3e}")


if __name__ == "__main__":
    main()
