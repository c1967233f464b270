"""Fine-tune a Hugging Face DSA model with ``attn_implementation="dsa_tilelang"`` and accelerate.

    python examples/hf_finetune.py --model tiny:glm_moe_dsa --steps 50             # CPU, seconds
    python examples/hf_finetune.py --model PATH_OR_HUB_ID --seq-len 32768 --bf16   # one GPU
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 --fsdp_cpu_ram_efficient_loading false \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap GlmMoeDsaDecoderLayer \\
        examples/hf_finetune.py --model PATH --bf16                                 # FSDP2, 2 GPUs
    python examples/hf_finetune.py --model tiny:glm_moe_dsa --lora                 # LoRA (needs peft)
    python examples/hf_finetune.py --model tiny:glm_moe_dsa --indexer-loss 0.01    # train the indexers too

The model loads with ``attn_implementation="dsa_tilelang"`` (installing the package registered it) and
trains as any transformers model: ``accelerate`` places it (one device, DDP or FSDP2 from its launch
config), mixed precision with ``--bf16`` (fp32 weights under autocast: the ops take the autocast dtype, so the
bf16 kernels run). FSDP2 needs ``--fsdp_cpu_ram_efficient_loading false`` for the MoE models: that loading
path of accelerate 1.15 expects every state-dict entry to be a sharded parameter, and their router bias
(``e_score_correction_bias``) is a buffer. ``--indexer-loss W`` adds the indexer KL loss with weight W,
fused into the attention backward (``dsa_plugins.hf.enable_indexer_loss``): transformers' indexers get no
gradient otherwise. ``--attn eager`` runs the same loop on transformers' eager attention, to compare.

Data: ``--data FILE`` (a text file, tokenised with the model's tokenizer, packed into ``--seq-len``
blocks) or, without it, synthetic counting sequences (learnable in tens of steps: a smoke run). ``--model tiny:<model_type>`` builds the tiny
random model of ``dsa_plugins.adapters.hf.tiny`` (no download). Prints one line per logged step; with
``--log FILE`` also writes them as JSON lines (step, loss, indexer KL).
"""

from __future__ import annotations

import argparse
import json
import math

import torch


# GLM-5's attention and indexer head sizes (64 heads, latent 512 + rope 64, indexer 32 x 128) on a tiny
# model: small enough for a smoke run, shaped so that the GPU kernels serve it
KERNEL_DIMS = dict(num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                   qk_nope_head_dim=128, v_head_dim=128, index_n_heads=32, index_head_dim=128, index_topk=64)


def build_model(name: str, attn: str, dtype, kernel_dims: bool = False):
    """(model, vocab size): a tiny random model (``tiny:<model_type>``) or a pretrained one."""
    if name.startswith("tiny:"):
        from dsa_plugins.adapters.hf import tiny

        model = tiny.tiny_model(name.split(":", 1)[1], seed=0, **(KERNEL_DIMS if kernel_dims else {})).to(dtype)
        model.set_attn_implementation(attn)
        return model, model.config.get_text_config().vocab_size
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=attn)
    return model, model.config.get_text_config().vocab_size


def token_blocks(args, vocab: int) -> torch.Tensor:
    """[N, seq_len] token ids: the packed text of ``--data``, or random ids (seeded)."""
    if args.data:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        with open(args.data, encoding="utf-8") as f:
            ids = torch.tensor(tok(f.read())["input_ids"], dtype=torch.long)
        n = ids.numel() // args.seq_len
        if n == 0:
            raise SystemExit(f"--data holds {ids.numel()} tokens, fewer than --seq-len {args.seq_len}")
        return ids[: n * args.seq_len].view(n, args.seq_len)
    # no data: counting sequences (start and stride random per block, modulo the vocabulary), which a
    # model learns within tens of steps, so the loss curve says something
    g = torch.Generator().manual_seed(args.seed)
    n = args.steps * args.batch_size
    start = torch.randint(0, vocab - 3, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return 3 + (start + stride * torch.arange(args.seq_len)) % (vocab - 3)


def apply_lora(model, rank: int):
    """LoRA adapters on the attention projections (peft); the indexers stay trainable for their loss."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise SystemExit("--lora needs peft: pip install peft") from exc
    projections = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj", "wq_a", "wq_b", "wkv",
                   "wo_a", "wo_b"}
    # the attention's projections by their full names: the indexers have a wq_b too, and they train whole
    # (their weights are not part of the adapter: save the model's indexers with it when you train them)
    targets = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                     and n.rsplit(".", 1)[-1] in projections and ".indexer." not in n)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0))
    for n, p in model.named_parameters():
        if ".indexer." in n:
            p.requires_grad_(True)
    return model


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:glm_moe_dsa")
    parser.add_argument("--attn", default="dsa_tilelang", help="dsa_tilelang (default) or eager, to compare")
    parser.add_argument("--data", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU)")
    parser.add_argument("--lora", type=int, nargs="?", const=8, default=0, metavar="RANK")
    parser.add_argument("--indexer-loss", type=float, default=0.0, metavar="WEIGHT")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--kernel-dims", action="store_true",
                        help="tiny models only: GLM-5's attention head sizes, so that the GPU kernels run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--log", default=None, help="write the logged steps as JSON lines")
    args = parser.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import set_seed

    import dsa_plugins.hf

    dsa_plugins.hf.register()  # a no-op when the entry point already did it
    accelerator = Accelerator(mixed_precision="bf16" if args.bf16 else "no")
    set_seed(args.seed)
    model, vocab = build_model(args.model, args.attn, torch.float32, args.kernel_dims)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora:
        model = apply_lora(model, args.lora)
    handle = None
    if args.indexer_loss:
        handle = dsa_plugins.hf.enable_indexer_loss(model, weight=args.indexer_loss)
    model.train()
    blocks = token_blocks(args, vocab)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(blocks), batch_size=args.batch_size,
                                         shuffle=False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    log, step = [], 0
    while step < args.steps:
        for (ids,) in loader:
            out = model(input_ids=ids, labels=ids, use_cache=False)
            accelerator.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            kl = handle.mean() if handle is not None else None
            row = {"step": step, "loss": float(out.loss.detach())}
            if kl is not None:
                row["indexer_kl"] = float(kl)
            log.append(row)
            if accelerator.is_main_process and (step % args.log_every == 0 or step == 1):
                extra = f"  indexer KL {row['indexer_kl']:.4g}" if "indexer_kl" in row else ""
                print(f"step {step:5d}  loss {row['loss']:.4f}{extra}", flush=True)
            if not math.isfinite(row["loss"]):
                raise SystemExit(f"loss is {row['loss']} at step {step}")
            if step >= args.steps:
                break
    if args.log and accelerator.is_main_process:
        with open(args.log, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
    return log


if __name__ == "__main__":
    main()
