"""``python -m dsa_plugins warmup [MODEL_OR_CONFIG ...]``: compile the kernels a model needs ahead of
its first call, in parallel worker processes, and fill TileLang's disk cache.

A kernel is compiled once per configuration (head dims, sink, dtype, tiling); lengths, batch and
head counts of the forward are runtime values. Without warmup, each configuration compiles on its
first call (seconds to a minute each, one log line per kernel); with it, a new process loads them
from TileLang's disk cache.

MODEL_OR_CONFIG: a folder or ``config.json`` of a Hugging Face model, a hub id (read with
transformers' ``AutoConfig``), or a preset (``glm5``, ``deepseek_v32``, ``deepseek_v4``). Without one,
every configuration the package ships is compiled.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context

__all__ = ["KernelJob", "ModelDims", "jobs_for", "main", "model_dims"]

# The DSA dims of the presets (the real models' configs), so warmup needs no download.
PRESETS: dict[str, dict] = {
    "glm5": dict(heads=64, dim_qk=576, dim_v=512, sink=False, index_heads=32, index_dim=128, topk=2048),
    "deepseek_v32": dict(heads=128, dim_qk=576, dim_v=512, sink=False, index_heads=64, index_dim=128, topk=2048),
    "deepseek_v4": dict(heads=128, dim_qk=512, dim_v=512, sink=True, index_heads=64, index_dim=128, topk=1024),
}
# Model types whose attention has per-head sinks (the others have none).
_SINK_MODEL_TYPES = ("hy_v4", "hy_v4_vl", "deepseek_v4")  # a text config's "<type>_text" too


@dataclass(frozen=True)
class ModelDims:
    """What selects a model's kernel configurations: attention heads and head dims, sinks, the
    indexer's heads and head dim, and its top-k (how many parts a generation step's row is cut into)."""

    heads: int
    dim_qk: int
    dim_v: int
    sink: bool
    index_heads: int
    index_dim: int
    topk: int = 2048


@dataclass(frozen=True)
class KernelJob:
    """One compile: ``module.function(*args, target=...)``; ``gpu_target`` is the target the op
    passes at run time on a Hopper GPU (the disk cache is keyed by it): "sm_90a" or "auto"."""

    label: str
    module: str
    function: str
    args: tuple = ()
    gpu_target: str = "sm_90a"
    #: rough compile time on one core (TileLang 0.1.15, sm_90a): the longest jobs start first, so the
    #: wall time is about the longest job's rather than that of whichever one happened to start last
    seconds: float = 5.0


def _attr(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _dims_of(cfg, model_type: str) -> ModelDims | None:
    heads = _attr(cfg, "num_attention_heads")
    index_heads = _attr(cfg, "index_n_heads", "indexer_n_heads", "index_heads")
    index_dim = _attr(cfg, "index_head_dim", "indexer_head_dim")
    rank = _attr(cfg, "kv_lora_rank")
    if rank is not None:  # absorbed MLA over the latent
        dim_qk, dim_v = rank + _attr(cfg, "qk_rope_head_dim", default=0), rank
    else:
        dim_qk = dim_v = _attr(cfg, "head_dim")
    if None in (heads, index_heads, index_dim, dim_qk):
        return None
    sink = model_type.removesuffix("_text") in _SINK_MODEL_TYPES or bool(getattr(cfg, "attention_sink", False))
    topk = int(_attr(cfg, "index_topk", "indexer_topk", default=2048))
    return ModelDims(int(heads), int(dim_qk), int(dim_v), sink, int(index_heads), int(index_dim), topk)


def model_dims(config) -> list[ModelDims]:
    """The DSA dims of a transformers config (its text config; each layer's where the config is
    per layer). Raises ValueError when no layer has DSA dims."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")
    layers = getattr(text, "per_layer_config", None) or [text]
    kinds = getattr(text, "layer_types", None)
    if kinds is not None and len(kinds) == len(layers) and len(layers) > 1:  # only the layers with an indexer
        layers = [layer for layer, kind in zip(layers, kinds) if "sliding" not in str(kind)]
    dims = []
    for layer in layers:
        try:
            d = _dims_of(layer, model_type)
        except Exception:  # a per-layer attribute read globally (heterogeneous configs)
            d = None
        if d is not None and d not in dims:
            dims.append(d)
    if not dims:
        raise ValueError(f"warmup: the {model_type} config has no attention heads, indexer heads / head dim and "
                         "kv_lora_rank or head_dim: not a DSA model")
    return dims


def load_dims(spec: str) -> list[ModelDims]:
    """The ModelDims of a preset name, a config.json (or its folder) or a hub id."""
    if spec in PRESETS:
        return [ModelDims(**PRESETS[spec])]
    from transformers import AutoConfig

    path = (os.path.dirname(spec) or ".") if spec.endswith(".json") else spec
    return model_dims(AutoConfig.from_pretrained(path))


# backward programs: the main ones take 15-20 s, the preprocess and reduce programs a few seconds
_BWD_SECONDS = {"main_det": 20, "main_det_probs": 20, "preprocess": 3, "preprocess_det": 3, "reduce": 3}


def jobs_for(dims: ModelDims | None, training: bool = True, notes: list | None = None,
             fp8_index: bool = False) -> list[KernelJob]:
    """The compiles one model needs (None: every shipped configuration); ``training`` adds the
    backward and the indexer loss programs; ``fp8_index`` the fp8 indexer's (the opt-in fp8 index cache).
    Attention dims the kernels do not take compile nothing (those layers run the torch reference): a line
    in ``notes`` says so."""
    import torch

    from .common.settings import decode_cluster_parts, decode_part_slots
    from .kernels import (contrib_reduce, indexer, indexer_loss, row_scan, sparse_attention_bwd, sparse_attention_fwd,
                          topk)

    fwd, bwd, idx, loss, tk = (m.__name__ for m in (sparse_attention_fwd, sparse_attention_bwd, indexer,
                                                     indexer_loss, topk))
    jobs: list[KernelJob] = []
    if dims is None:
        attn = [(c["dim_qk"], c["dim_v"], c["has_sink"]) for c in sparse_attention_fwd.SHIPPED_CONFIGS]
        bwd_cfgs = [dict(c) for c in sparse_attention_bwd.SHIPPED_CONFIGS]
        idx_cfgs = [dict(c) for c in indexer.SHIPPED_CONFIGS]
        loss_cfgs = [dict(c) for c in indexer_loss.SHIPPED_CONFIGS]
        grad_cfgs = [dict(c) for c in indexer.GRAD_CONFIGS]
    else:
        attn = [(dims.dim_qk, dims.dim_v, dims.sink)]
        reason = sparse_attention_fwd.unsupported_reason(dims.heads, dims.dim_qk, dims.dim_v, dims.sink, torch.bfloat16)
        if reason:
            if notes is not None:
                notes.append(f"attention {dims.dim_qk}/{dims.dim_v}: no kernel ({reason}); runs on the torch reference")
            attn = []
        bwd_cfgs = [{"heads": dims.heads, "dqk": dims.dim_qk, "dv": dims.dim_v, "has_sink": dims.sink,
                     "dtype": "bfloat16"}]
        # prefill / training, and generation steps (one query row per CTA)
        idx_cfgs = [indexer.default_config(dims.index_heads, dims.index_dim, fp8=fp8, rows=rows)
                    for fp8 in ((False, True) if fp8_index else (False,)) for rows in (None, indexer.DECODE_MAX_ROWS)]
        loss_cfgs = [{"kind": "attn_probs", "dim": dims.dim_qk, "lse_pass": p} for p in (False, True)]
        # the value-only program, and with gradients: atomic or deterministic, two passes or given the indexer's
        # lse(I) (what the adapters pass)
        loss_cfgs += [{"kind": "loss", "heads": 64, "dim": dims.index_dim, "grads": False}]
        loss_cfgs += [{"kind": "loss", "heads": 64, "dim": dims.index_dim, "grads": True, "det": det, "lse_given": lg}
                      for det in (False, True) for lg in (False, True)]
        # the dense warm-up loss: the tiled normaliser and target (query heads and score tiles as
        # indexer_kl_loss_dense runs them), the row program, the score-gradient programs (index heads padded as
        # indexer_kl_loss_dense pads them)
        dense_scores = indexer_loss.dense_score_config(dims.index_heads, dims.index_dim)
        loss_cfgs += [{"kind": kind, "heads": indexer_loss.dense_target_heads(dims.heads), "dim": dims.dim_qk,
                       "block_q": dense_scores["block_q"], "block_k": dense_scores["block_k"]}
                      for kind in ("dense_target", "dense_norm")]
        loss_cfgs += [{"kind": "dense_terms", "grads": g} for g in (False, True)]
        grad_cfgs = [indexer.grad_config(dense_scores)]
        if training and dense_scores not in idx_cfgs:
            idx_cfgs.append(dense_scores)
    for dqk, dv, sink in attn:
        cfg = sparse_attention_fwd.config_for(dqk, dv, sink, torch.bfloat16)
        jobs.append(KernelJob(f"attention forward {dqk}/{dv}{' sink' if sink else ''}", fwd, "build_fwd_kernel",
                              (cfg,), seconds=35))
    if attn:  # the prefill's per-row trip counts (skip_tail), one launch before the forward
        jobs.append(KernelJob("attention row block counts", row_scan.__name__, "build_row_blocks", (), seconds=5))
    # generation steps cut into parts (their schedule, PARTS_SCHEDULE), merged inside a cluster: for every shipped
    # model's top-k, or this one's; rows left whole run the prefill's program above
    if dims is None:
        decode_cfgs = [dict(c) for c in sparse_attention_fwd.DECODE_CLUSTER_CONFIGS]
    else:
        # the part count follows the heads a rank holds: the whole model's, and its tensor-parallel shards'
        shard_heads = [dims.heads // 2**i for i in range(4) if dims.heads // 2**i >= 16]
        counts = set() if decode_part_slots() else {decode_cluster_parts(dims.topk, h) for h in shard_heads} - {0}
        decode_cfgs = [sparse_attention_fwd.config_for(dqk, dv, sink, torch.bfloat16,
                                                       {"schedule": sparse_attention_fwd.PARTS_SCHEDULE,
                                                        "cluster_parts": parts})
                       for dqk, dv, sink in attn for parts in sorted(counts)]
    for cfg in decode_cfgs:
        jobs.append(KernelJob(f"attention forward {cfg['dim_qk']}/{cfg['dim_v']}{' sink' if cfg['has_sink'] else ''}"
                              f" decode, {cfg['cluster_parts']} parts", fwd, "build_fwd_kernel", (cfg,), seconds=35))
    if decode_part_slots():  # the decode split's programs (DSA_PLUGINS_DECODE_PART_SLOTS)
        for dqk, dv, sink in attn:
            cfg = sparse_attention_fwd.config_for(dqk, dv, False, torch.bfloat16,
                                                  {"schedule": sparse_attention_fwd.PARTS_SCHEDULE, "partial": True})
            jobs.append(KernelJob(f"attention forward {dqk}/{dv} decode parts", fwd, "build_fwd_kernel", (cfg,),
                                  seconds=35))
            jobs.append(KernelJob(f"attention decode combine {dv}{' sink' if sink else ''}", fwd,
                                  "build_combine_kernel", (dv, sink, "bfloat16")))
    for cfg in idx_cfgs:
        fp8 = " fp8" if cfg.get("fp8") else ""
        step = (", generation steps" if cfg in indexer.DECODE_CONFIGS
                else ", dense loss tiling" if cfg not in indexer.PREFILL_CONFIGS else "")
        jobs.append(KernelJob(f"indexer scores Hi{cfg['heads']} Di{cfg['dim']}{fp8}{step}", idx, "build_indexer", (cfg,),
                              gpu_target="auto"))
    for bq, bk in sorted({(c["block_q"], c["block_k"]) for c in idx_cfgs}):
        jobs.append(KernelJob(f"indexer block ranges {bq}x{bk}", idx, "build_block_ranges", (bq, bk),
                              gpu_target="auto"))
    for cfg in topk.SHIPPED_CONFIGS:
        if cfg.get("lse") and not training:  # the variants that feed the indexer loss
            continue
        agg = ", warp-aggregated" if cfg.get("agg") else ""
        split = f", a row over {cfg['parts']} CTAs" if cfg.get("parts") else ""
        jobs.append(KernelJob(f"radix top-k {cfg['threads']} threads{agg}{split}{', lse' if cfg.get('lse') else ''}", tk,
                              "build_topk", (dict(cfg),),
                              gpu_target="auto", seconds=9))
    jobs.append(KernelJob("top-k finish (ties, order)", tk, "build_finish", gpu_target="auto", seconds=7))
    if training and attn:
        for cfg in bwd_cfgs:  # one job per program: they compile side by side
            for name in sparse_attention_bwd.bwd_program_names(cfg):
                jobs.append(KernelJob(f"attention backward H{cfg['heads']} {cfg['dqk']}/{cfg['dv']}"
                                      f"{' sink' if cfg['has_sink'] else ''} {name}", bwd, "build_bwd_program",
                                      (cfg, name), seconds=_BWD_SECONDS.get(name, 15)))
        for cfg in loss_cfgs:
            jobs.append(KernelJob(f"indexer loss {cfg['kind']} " + " ".join(f"{k}={v}" for k, v in cfg.items()
                                                                              if k != "kind"),
                                  loss, "build_config", (cfg,), seconds=15))
        for cfg in grad_cfgs:  # the dense warm-up loss's d_index_q / d_weights and d_index_k
            for side in ("query", "key"):
                jobs.append(KernelJob(f"indexer score gradients Hi{cfg['heads']} Di{cfg['dim']} {side}-major", idx,
                                      "build_score_grads", (side, cfg), gpu_target="auto", seconds=6))
        # the deterministic loss's d_index_k reduce (the attention's reduce is one of its backward programs)
        for di in sorted({c["dim"] for c in loss_cfgs if c.get("det")}):
            jobs.append(KernelJob(f"indexer loss d_index_k reduce Di{di} (deterministic mode)", contrib_reduce.__name__,
                                  "build_reduce", (di, 1, "float32"), seconds=3))
    return jobs


def _target(job: KernelJob, on_gpu: bool):
    from .kernels import CPU_COMPILE_TARGET

    if on_gpu and job.gpu_target == "auto":
        return None
    return dict(CPU_COMPILE_TARGET)  # explicit sm_90a: what the ops pass on Hopper, and a CPU build


def run_job(job: KernelJob, on_gpu: bool) -> tuple[str, float, str | None]:
    """Compile one job in this process: (label, seconds, error or None)."""
    t0 = time.perf_counter()
    try:
        getattr(importlib.import_module(job.module), job.function)(*job.args, target=_target(job, on_gpu))
    except Exception as exc:  # reported, the other jobs go on
        return job.label, time.perf_counter() - t0, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return job.label, time.perf_counter() - t0, None


def _progress(total: int):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="kernel", desc="dsa_plugins warmup", file=sys.stderr)
    except ImportError:
        return None


def compile_jobs(jobs: list[KernelJob], workers: int, on_gpu: bool) -> list[tuple[str, float, str | None]]:
    """Run the jobs in ``workers`` processes (spawned: a CUDA context is not forked), with a
    progress bar on stderr (tqdm) and one line per finished kernel."""
    results = []
    bar = _progress(len(jobs))
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(run_job, job, on_gpu) for job in jobs]
        for i, fut in enumerate(as_completed(futures), 1):
            label, seconds, error = fut.result()
            results.append((label, seconds, error))
            line = f"[{i}/{len(jobs)}] {label}: " + (f"FAILED {error}" if error else f"{seconds:.1f} s")
            if bar is not None:
                bar.update(1)
                bar.write(line)
            else:
                print(line, flush=True)
    if bar is not None:
        bar.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_plugins warmup", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="model folders, config.json files, hub ids or presets "
                        f"({', '.join(PRESETS)}); none: every shipped configuration")
    parser.add_argument("--inference", action="store_true", help="forward and indexer only (no backward, no loss)")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument("--list", action="store_true", help="print the kernels it would compile and stop")
    parser.add_argument("--fp8-index", action="store_true",
                        help="also the fp8 indexer's programs (dsa_plugins.hf.enable_fp8_index_cache)")
    args = parser.parse_args(argv)
    try:
        dims = [d for m in args.models for d in load_dims(m)] or [None]
    except (OSError, ValueError) as exc:
        print(f"warmup: {exc}", file=sys.stderr)
        return 2
    jobs, seen, notes = [], set(), []
    for d in dims:
        for job in jobs_for(d, training=not args.inference, notes=notes, fp8_index=args.fp8_index):
            key = (job.module, job.function, json.dumps(job.args, sort_keys=True, default=str))
            if key not in seen:
                seen.add(key)
                jobs.append(job)
    for note in notes:
        print(f"warmup: {note}", file=sys.stderr)
    jobs.sort(key=lambda job: -job.seconds)  # longest first (stable: equal ones keep their order)
    if args.list:
        for job in jobs:
            print(job.label)
        return 0
    from .kernels import device_unavailable_reason, tilelang_import_error

    reason = tilelang_import_error()
    if reason:
        print(f"warmup: {reason}", file=sys.stderr)
        return 2
    on_gpu = device_unavailable_reason() is None
    where = "this GPU" if on_gpu else "sm_90a (no Hopper GPU here: the cache serves a GPU run only where its keys match)"
    print(f"warmup: {len(jobs)} kernels for {where}, {args.jobs} at a time", flush=True)
    t0 = time.perf_counter()
    results = compile_jobs(jobs, args.jobs, on_gpu)
    failed = [r for r in results if r[2]]
    print(f"warmup: {len(results) - len(failed)} compiled, {len(failed)} failed, {time.perf_counter() - t0:.1f} s",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
