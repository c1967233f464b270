"""One Hugging Face DSA attention layer at long context, prefill forward + backward:
``attn_implementation="dsa_tilelang"`` (dsa_plugins) vs transformers' ``sdpa`` and ``eager``.

    python benchmarks/bench_hf_layer.py                                  # GPU, GLM-5 dims, 8K..128K
    python benchmarks/bench_hf_layer.py --model deepseek_v32 --seqlens 8192,32768
    python benchmarks/bench_hf_layer.py --model deepseek_v4              # one CSA layer, V4-Flash dims
    python benchmarks/bench_hf_layer.py --smoke                          # CPU, tiny dims, seconds

Layer: the model class with one decoder layer and a small dense MLP (intermediate 1024; DeepSeek-V4
keeps its MoE block, shrunk to 4 experts), bf16 on GPU, batch 1, causal, no KV cache; input
embeddings require grad, loss = mean(last_hidden_state^2). GLM-5 dims (zai-org/GLM-5 config.json):
hidden 6144, 64 heads, q_lora 2048, kv_lora 512, rope 64, nope 192, v_head 256, indexer 32 x 128,
top-k 2048. Rows (median, 20/80% quantiles, peak memory; an out-of-memory is a row too) go to
``benchmarks/results/hf_layer.{csv,md}`` through ``dsa_plugins.bench.runner``. The baselines measured
on an H200 with transformers 5.17 are in DSA.md section 5 (sdpa: 126.6 ms / 19.0 GiB at 8K, OOM at 32K).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DIMS = {
    "glm5": (
        "glm_moe_dsa",
        dict(
            hidden_size=6144, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=2048, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128,
            index_topk=2048, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    "deepseek_v32": (
        "deepseek_v32",
        dict(
            hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64, index_head_dim=128,
            index_topk=2048,
        ),
    ),
    "deepseek_v4": (
        "deepseek_v4",
        dict(
            hidden_size=4096, num_attention_heads=64, head_dim=512, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
            index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"], n_routed_experts=4,
            num_experts_per_tok=1, moe_intermediate_size=1024, hc_mult=4,
        ),
    ),
}

_ONE_LAYER = {
    "glm_moe_dsa": dict(num_hidden_layers=1, mlp_layer_types=["dense"], indexer_types=["full"], intermediate_size=1024),
    "deepseek_v32": dict(num_hidden_layers=1, mlp_layer_types=["dense"], intermediate_size=1024),
    "deepseek_v4": dict(num_hidden_layers=1, layer_types=["compressed_sparse_attention"], mlp_layer_types=["moe"]),
}


def build_layer(model: str, provider: str, smoke: bool, device, dtype, layers: int = 1):
    """The base model (no LM head) with ``layers`` decoder layers (default one), random weights."""
    import transformers

    from dsa_plugins.adapters.hf import tiny

    model_type, dims = DIMS[model]
    kwargs = dict(tiny.SPECS[model_type][2])  # small vocab, ids, rope defaults of the tiny config
    one = _ONE_LAYER[model_type]
    # ``layers`` copies of the one layer (per-layer costs as the difference of two depths)
    kwargs.update(one, num_hidden_layers=layers, **{k: v * layers for k, v in one.items() if isinstance(v, list)})
    if not smoke:
        kwargs.update(dims)
    kwargs["max_position_embeddings"] = 1 << 18
    config_cls, lm_cls, _ = tiny.SPECS[model_type]
    config = getattr(transformers, config_cls)(**kwargs)
    base_cls = getattr(transformers, lm_cls.replace("ForCausalLM", "Model"))
    torch.manual_seed(0)
    with torch.device(device):
        layer = base_cls._from_config(config, attn_implementation=provider, dtype=dtype)
    return layer.train(), config


def step_fn(layer, config, seqlen: int, device, dtype):
    x = torch.randn(1, seqlen, config.hidden_size, device=device, dtype=dtype) * 0.02
    x.requires_grad_(True)

    def step():
        out = layer(inputs_embeds=x, use_cache=False).last_hidden_state
        loss = out.float().pow(2).mean()
        loss.backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None
        return loss

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(DIMS), default="glm5")
    parser.add_argument("--seqlens", default="8192,32768,65536,131072")
    parser.add_argument("--providers", default="dsa_tilelang,sdpa,eager")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny dims, 2 reps, no result files")
    parser.add_argument("--indexer-loss", type=float, default=0.0, metavar="WEIGHT",
                        help="also time dsa_tilelang with dsa_plugins.hf.enable_indexer_loss (mode 'full+indexer_loss')")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    import dsa_plugins.hf
    from dsa_plugins.bench.runner import env_info, time_callable, write_results

    dsa_plugins.hf.register()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no GPU: running the CPU smoke mode")
        args.smoke = True
    seqlens = [64, 128] if args.smoke else [int(s) for s in args.seqlens.split(",")]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    providers = args.providers.split(",")
    if DIMS[args.model][0] == "deepseek_v4":  # V4 supports only eager in transformers
        providers = [p for p in providers if p != "sdpa"]
    env = env_info(device)
    rows = []
    runs = [(p, False) for p in providers]
    if args.indexer_loss and "dsa_tilelang" in providers:
        runs.insert(providers.index("dsa_tilelang") + 1, ("dsa_tilelang", True))
    for seqlen in seqlens:
        for provider, with_loss in runs:
            name = "smoke" if args.smoke else args.model
            shape = f"{name} S{seqlen}"
            mode = "full+indexer_loss" if with_loss else "full"
            row = {"op": f"hf_{DIMS[args.model][0]}_layer", "provider": provider, "mode": mode, "shape": shape, **env}
            layer = step = None
            try:
                layer, config = build_layer(args.model, provider, args.smoke, device, dtype)
                if with_loss:
                    dsa_plugins.hf.enable_indexer_loss(layer, weight=args.indexer_loss)
                step = step_fn(layer, config, seqlen, device, dtype)
                med, p20, p80, peak = time_callable(
                    step, device, warmup=1 if args.smoke else 2, reps=2 if args.smoke else args.reps
                )
                row.update(median_ms=med, p20_ms=p20, p80_ms=p80, peak_gib=peak)
                print(f"{shape:<24} {provider:<14} {mode:<18} {med:10.2f} ms  peak {peak:.2f} GiB", flush=True)
            except Exception as exc:  # an out-of-memory is a result, not a crash
                row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:100]}"
                print(f"{shape:<24} {provider:<14} {mode:<18} {row['error']}", flush=True)
            finally:
                layer = step = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    for seqlen in seqlens:  # speed-up over the best baseline that ran
        mine = [r for r in rows if r["shape"].endswith(f"S{seqlen}") and r["provider"] == "dsa_tilelang"
                and r["mode"] == "full"]
        base = [r for r in rows if r["shape"].endswith(f"S{seqlen}") and r["provider"] != "dsa_tilelang"
                and "median_ms" in r]
        if mine and "median_ms" in mine[0] and base:
            best = min(base, key=lambda r: r["median_ms"])
            mine[0][f"speedup_vs_{best['provider']}"] = best["median_ms"] / mine[0]["median_ms"]
    if not args.smoke:
        paths = write_results(rows, Path(args.out), f"hf_layer_{args.model}")
        print("results:", ", ".join(str(p) for p in paths if p))
    return 0 if all("error" not in r for r in rows if r["provider"] == "dsa_tilelang") else 1


if __name__ == "__main__":
    raise SystemExit(main())
