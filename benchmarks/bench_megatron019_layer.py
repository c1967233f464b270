"""One megatron-core 0.19 DSA layer, training step (forward + backward, sparse indexer loss on), by
megatron's DSA kernel backend: ``tilelang`` (dsa_plugins), ``megatron_tilelang`` (megatron's own
vendored TileLang backend), ``megatron_cudnn`` (megatron's cudnn backend: FlashMLA's forward and cuDNN
frontend's backward and indexer kernels; needs both peers staged, see ``benchmarks/peers/``),
``torch`` (``dsa_kernel_backend="none"``, megatron's torch path).

    python benchmarks/bench_megatron019_layer.py [--seqlens 8192,32768] [--providers ...] [--stage sparse|dense]

``--stage dense``: the dense warm-up stage (indexer loss against dense attention, sparse_loss off).

GLM-5 attention dims (64 heads, 576/512 latent, indexer 32 x 128, top-k 2048), hidden 6144, one
layer with a small dense MLP, bf16, batch 1, causal. Rows go to
``benchmarks/results/megatron019_layer.{csv,md}`` through ``dsa_plugins.bench.runner``; an
out-of-memory or an unsupported backend is a row too. The model builder is the tests' (CPU shims
unused on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "adapters", "megatron"))

GLM5 = dict(hidden_size=6144, num_attention_heads=64, ffn_hidden_size=1024, q_lora_rank=2048, kv_lora_rank=512,
            qk_head_dim=192, qk_pos_emb_head_dim=64, v_head_dim=256, dsa_indexer_n_heads=32, dsa_indexer_head_dim=128)
PROVIDERS = {"tilelang": "dsa_plugins", "megatron_tilelang": "tilelang", "megatron_cudnn": "cudnn", "torch": "none"}


def _accept_nv_dev_flash_mla_call() -> None:
    """megatron 0.19's cudnn backend calls FlashMLA's ``nv_dev`` branch, whose sparse forward takes an
    extra ``indexer_topk`` argument (0: no fused indexer top-k). The released FlashMLA (the staged peer)
    has the same kernel without that argument: accept it when it is 0, refuse anything else."""
    try:
        import inspect

        import flash_mla
    except ImportError:
        return
    fwd = flash_mla.flash_mla_sparse_fwd
    if "indexer_topk" in inspect.signature(fwd).parameters:
        return

    def sparse_fwd(*args, indexer_topk: int = 0, **kwargs):
        if indexer_topk:
            raise NotImplementedError("this FlashMLA build has no fused indexer top-k")
        return fwd(*args, **kwargs)

    flash_mla.flash_mla_sparse_fwd = sparse_fwd
    print("note: FlashMLA without the nv_dev indexer_topk argument: megatron's indexer_topk=0 calls are passed on without it")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", default="8192,32768")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--stage", default="sparse", choices=["sparse", "dense"])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args(argv)
    import mcore019 as M

    from dsa_plugins.adapters import megatron as adapter
    from dsa_plugins.bench.runner import env_info, time_callable, write_results

    os.environ["DSA_PLUGINS_MEGATRON_TAKEOVER"] = "0"
    if "megatron_cudnn" in args.providers:
        _accept_nv_dev_flash_mla_call()
    M.init_distributed(port=29400 + os.getpid() % 500)
    adapter.register()
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    device = torch.device("cuda")
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
    env = env_info(device)
    rows = []
    for s in (int(x) for x in args.seqlens.split(",")):
        for provider in args.providers.split(","):
            row = {"op": "megatron019_dsa_layer", "mode": "full" if args.stage == "sparse" else "full_dense_loss", "shape": f"GLM-5 dims T{s} k2048",
                   "provider": provider, **env}
            try:
                _, model = M.build(backend=PROVIDERS[provider], dims=GLM5, topk=2048, num_layers=1,
                                   dtype=torch.bfloat16, device="cuda", loss_coeff=1.0,
                                   sparse_loss=args.stage == "sparse")
                tokens, labels = M.batch(b=1, s=s, seed=0, device="cuda")
                position_ids = torch.arange(s, device=device).unsqueeze(0)
                model.train()

                def train_step():
                    loss = model(tokens, position_ids, attention_mask=None, labels=labels)
                    loss.float().mean().backward()

                med, p20, p80, peak = time_callable(train_step, device, warmup=2, reps=5)
                row.update(median_ms=med, p20_ms=p20, p80_ms=p80, peak_gib=peak)
                print(f"T{s} {provider:<18} {med:9.2f} ms  peak {peak:.1f} GiB", flush=True)
            except Exception as exc:  # an OOM or an unsupported backend is a result
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                print(f"T{s} {provider:<18} ERROR {row['error']}", flush=True)
            rows.append(row)
            model = None
            torch.cuda.empty_cache()
    print("wrote", write_results(rows, Path(args.out), "megatron019_layer")[:2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
