"""One Megatron-core DSA transformer layer, training step (forward + backward with the indexer
loss): dsa_plugins' modules vs megatron-core's own DSAttention (dense fp32 ``unfused_dsa_fn``).

    python benchmarks/bench_megatron_layer.py                       # GPU, GLM-5 dims, 4K..32K tokens
    python benchmarks/bench_megatron_layer.py --model deepseek_v32 --seqlens 8192,32768
    python benchmarks/bench_megatron_layer.py --smoke               # CPU, tiny dims, seconds

Layer: MLA + DSA self-attention (model dims below) and a small dense MLP (ffn 1024, as the HF
baseline in DSA.md), bf16 on GPU, batch 1, causal, indexer loss on (sparse KL, coefficient 1),
local (non-TE) linears for both providers. Rows (median, 20/80% quantiles, peak memory) are
appended to ``benchmarks/results/megatron_layer.csv`` through ``dsa_plugins.bench.runner``. An
out-of-memory is a row too. megatron's Hadamard rotation needs ``fast_hadamard_transform``; when
missing it is replaced by the identity (it is orthonormal: same index scores up to rounding).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DIMS = {
    # hidden, heads, q_lora, kv_lora, nope, rope, v, indexer heads, indexer dim, topk
    "glm5": dict(hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_head_dim=192,
                 qk_pos_emb_head_dim=64, v_head_dim=256, dsa_indexer_n_heads=32, dsa_indexer_head_dim=128,
                 dsa_indexer_topk=2048),
    "deepseek_v32": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                         qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, dsa_indexer_n_heads=64,
                         dsa_indexer_head_dim=128, dsa_indexer_topk=2048),
    "smoke": dict(hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=8, v_head_dim=8, dsa_indexer_n_heads=4, dsa_indexer_head_dim=16,
                  dsa_indexer_topk=8),
}


def _init_megatron(device: torch.device) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if device.type == "cpu":
        torch.cuda.current_device = lambda: "cpu"  # RoPE and the loss tracker ask for it
    try:
        import transformer_engine  # noqa: F401
    except ImportError:  # megatron's MLA believes TE is there (its import shims succeed): local paths
        import megatron.core.transformer.moe.moe_utils as moe_utils
        import megatron.core.transformer.multi_latent_attention as mla

        mla.HAVE_TE = False
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)


def _config(dims: dict, dtype: torch.dtype, on_cpu: bool):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1, ffn_hidden_size=1024 if not on_cpu else 64, rope_type="rope", rotary_base=10000,
        normalization="RMSNorm", layernorm_epsilon=1e-5, qk_layernorm=True, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, experimental_attention_variant="dsa",
        dsa_indexer_loss_coeff=1.0, dsa_indexer_use_sparse_loss=True, transformer_impl="local",
        use_cpu_initialization=on_cpu, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02, **dims,
    )


def _layer(provider: str, config, model: str):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.experimental_attention_variant import dsa as mdsa
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.spec_utils import build_module

    from dsa_plugins.adapters.megatron.layers import DuplicatedLinear
    from dsa_plugins.megatron import get_dsa_layer_spec

    if provider == "dsa_plugins":
        spec = get_dsa_layer_spec(config, use_transformer_engine=False, model=model)
    else:  # megatron-core's own DSA: MLASelfAttention (per-head K/V) + DSAttention + DSAIndexer
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
        attn = get_dsa_layer_spec(config, use_transformer_engine=False, model="megatron").submodules.self_attention
        attn.module = MLASelfAttention
        attn.submodules.linear_q_down_proj = attn.submodules.linear_kv_down_proj = ColumnParallelLinear
        core = attn.submodules.core_attention
        core.module, core.params = mdsa.DSAttention, {}
        core.submodules.indexer.module, core.submodules.indexer.params = mdsa.DSAIndexer, {}
        for name in ("linear_wq_b", "linear_wk", "linear_weights_proj"):
            setattr(core.submodules.indexer.submodules, name, DuplicatedLinear)
        spec.submodules.self_attention = attn
        if mdsa.hadamard_transform is None:
            mdsa.rotate_activation = lambda x: x
    return build_module(spec, config=config, layer_number=1)


def _step_fn(layer, seqlen: int, config, device):
    hidden = torch.randn(seqlen, 1, config.hidden_size, device=device, dtype=config.params_dtype, requires_grad=True)
    grad = torch.randn_like(hidden)

    def step():
        layer.zero_grad(set_to_none=True)
        out, _ = layer(hidden, attention_mask=None)
        out.backward(grad)
        return out

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("glm5", "deepseek_v32"), default="glm5")
    parser.add_argument("--seqlens", default="4096,8192,16384,32768")
    parser.add_argument("--providers", default="dsa_plugins,megatron_unfused")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny dims, 2 reps")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    from dsa_plugins.bench.runner import env_info, time_callable, write_results

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: running the CPU smoke mode")
        args.smoke = True
    seqlens = [64, 128] if args.smoke else [int(s) for s in args.seqlens.split(",")]
    dims = DIMS["smoke" if args.smoke else args.model]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    _init_megatron(device)
    config = _config(dims, dtype, device.type == "cpu")
    env = env_info(device)
    rows = []
    for seqlen in seqlens:
        name = "smoke" if args.smoke else args.model
        shape = f"{name} S{seqlen} H{dims['num_attention_heads']} k{dims['dsa_indexer_topk']}"
        for provider in args.providers.split(","):
            row = {"op": "megatron_dsa_layer", "provider": provider, "mode": "full", "shape": shape, **env}
            try:
                torch.manual_seed(0)
                # bf16 training casts every parameter (torch norms are built in fp32), as megatron's
                # Float16Module does
                layer = _layer(provider, config, args.model).to(device=device, dtype=config.params_dtype).train()
                step = _step_fn(layer, seqlen, config, device)
                med, p20, p80, peak = time_callable(step, device, warmup=1 if args.smoke else 3,
                                                    reps=2 if args.smoke else args.reps)
                row.update(median_ms=med, p20_ms=p20, p80_ms=p80, peak_gib=peak)
                print(f"{shape:<32} {provider:<18} {med:10.2f} ms  peak {peak:.2f} GiB")
            except Exception as exc:  # an out-of-memory is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
                print(f"{shape:<32} {provider:<18} {row['error']}")
            finally:
                layer = step = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    if not args.smoke:
        paths = write_results(rows, Path(args.out), "megatron_layer")
        print("results:", ", ".join(str(p) for p in paths if p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
