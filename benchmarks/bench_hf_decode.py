"""Generation steps of one Hugging Face DSA decoder layer over a long cache: per new token, eager
and with transformers' static cache under ``torch.compile`` (CUDA graphs).

    python benchmarks/bench_hf_decode.py                                 # GPU, GLM-5 dims, B 1 and 32
    python benchmarks/bench_hf_decode.py --model deepseek_v32 --contexts 4096,65536 --batches 1,32
    python benchmarks/bench_hf_decode.py --smoke                         # CPU, tiny dims, seconds
    python benchmarks/bench_hf_decode.py --modes eager_static --layers 1,4 --profile   # eager cost per layer
    python benchmarks/bench_hf_decode.py --fp8-index both    # also with the opt-in fp8 index cache
    python benchmarks/bench_hf_decode.py --left-pad 2048     # a left-padded batch (generate's 2D attention mask)

Model: the base model of ``bench_hf_layer.py`` (one decoder layer, small dense MLP, vocab 128, no LM
head: the time is the layer's), bf16, eval. The cache is filled with random latents and indexer keys
up to ``context`` tokens (a real prefill of B 32 x 128K tokens would take minutes and does not change
a decode step's work), then one token per sequence is decoded per step. Modes:

* ``eager_dynamic``: transformers' default ``DynamicCache``, no compile;
* ``eager_static``: ``StaticCache`` (fixed buffers), no compile;
* ``compiled_static``: ``StaticCache`` and ``torch.compile(mode="reduce-overhead", fullgraph=True)``,
  what ``generate(..., cache_implementation="static")`` runs for its decode steps on a GPU.

``--layers 1,4`` also builds a 4-layer model (the same layer repeated): an eager step's cost per layer is the
difference divided by 3 (a 1-layer step also pays the model's own per-step Python). ``--profile`` prints, for
each eager case, cProfile's cumulative host time of 20 more steps and torch.profiler's operators and kernel
launches of one (``profile_hf_decode_host.py`` times our functions one by one), and for each compiled case the GPU
time of each kernel of 10 replayed steps. ``--fp8-index on|both``: dsa_tilelang with
``enable_fp8_index_cache`` (the indexer's keys scored and cached in e4m3; rows with variant ``fp8_index``).

Rows (ms per step = per layer-token at B 1; tokens/s = B / step time; peak memory) go to
``benchmarks/results/hf_decode_<model>.{csv,md}``. sdpa (transformers' own path) runs at B 1, at the
smallest and the largest context. DeepSeek-V4 (``--model deepseek_v4``: one CSA layer, V4-Flash dims; sdpa cannot
serve it, ``--providers dsa_tilelang,eager`` runs transformers' eager path at B 1, dynamic cache) takes the
package's ``DsaV4StaticCache`` in the static modes (transformers has none for V4): its sliding window, compressor
rings and compressed entries (the CSA's and its indexer's, ``context / 4`` rows each) are filled with random values.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_hf_layer import DIMS, build_layer  # noqa: E402

from dsa_plugins.reference.indexer import quantize_fp8_rows  # noqa: E402

MODES = ("eager_dynamic", "eager_static", "compiled_static")


def _cache_kwarg(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def filled_cache(model, mode: str, batch: int, context: int, headroom: int, device, dtype, step_kv: bool = True):
    """A cache holding ``context`` random tokens per sequence (latent and indexer keys)."""
    from transformers import DynamicCache, StaticCache

    config = model.config
    static = mode != "eager_dynamic"
    v4 = config.model_type == "deepseek_v4"
    if static and v4:
        from dsa_plugins.hf import DsaV4StaticCache

        cache = DsaV4StaticCache(config, max_cache_len=context + headroom, step_kv=step_kv)
    elif static:
        cache = StaticCache(config=config, max_cache_len=context + headroom)
    else:
        cache = DynamicCache(config=config)
    g = torch.Generator(device=device).manual_seed(0)
    # (seeded: a case run twice in one process starts from the same cache, so its "diff" compares like with like)
    ids = torch.randint(3, config.vocab_size, (batch, 4), device=device, generator=g)
    with torch.no_grad():  # a short real prefill creates every buffer the model uses
        model(input_ids=ids, use_cache=True, **{_cache_kwarg(model): cache})
    if v4:
        _fill_v4(model, cache, context, g)
        return cache
    for layer in cache.layers:
        for name in ("keys", "values", "indexer_keys"):
            t = getattr(layer, name, None)
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            shape = (*t.shape[:-2], context, t.shape[-1])
            fill = torch.randn(shape, device=device, dtype=torch.float32, generator=g)
            scales = getattr(layer, "_dsa_index_key_scale", None)
            if t.dtype == torch.uint8 and scales is not None:  # the fp8 index cache: e4m3 bytes and their scales
                fill, fill_scales = quantize_fp8_rows(fill)
                fill = fill.view(torch.uint8)
                if static:
                    scales[:, :context].copy_(fill_scales)
                else:
                    layer._dsa_index_key_scale = fill_scales
            fill = fill.to(t.dtype)
            if static:
                t[..., :context, :].copy_(fill)  # in place: the static buffers keep their addresses
            else:
                setattr(layer, name, fill)
        for counter in ("cumulative_length", "indexer_cumulative_length"):
            c = getattr(layer, counter, None)
            if isinstance(c, torch.Tensor):
                c.fill_(context)
    return cache


def _fill_v4(model, cache, context: int, g) -> None:
    """DeepSeek-V4's caches as after ``context`` tokens (a multiple of 2 * each compress rate): the same random
    window rows, compressed entries and last two windows' projections in ours (fixed buffers, filled in place) and
    in transformers' dynamic layers (window, entries, the CSA overlap state), so that both modes decode alike."""
    for i, layer in enumerate(cache.layers):
        comp = model.layers[i].self_attn.compressor
        modules = {"compressor": comp} if comp is not None else {}
        if getattr(comp, "indexer", None) is not None:
            modules["indexer"] = comp.indexer
        ref = layer.keys
        window = torch.randn((*ref.shape[:2], model.config.sliding_window, ref.shape[-1]), device=ref.device,
                             generator=g).to(ref.dtype)  # positions context - W .. context - 1
        state = {}
        for name, module in modules.items():
            rate, dim, f = module.compress_rate, module.head_dim, module.kv_proj.out_features
            assert context % (2 * rate) == 0, f"context {context} is not a multiple of 2 x {rate}"
            state[name] = [torch.randn(shape, device=ref.device, generator=g).to(ref.dtype)
                           for shape in ((ref.shape[0], context // rate, dim), (ref.shape[0], 2 * rate, f),
                                         (ref.shape[0], 2 * rate, f))]  # entries, last 2 windows' kv and gate
        if getattr(layer, "dsa_v4_static", False):
            W = layer.window
            rows = (torch.arange(context - W, context, device=ref.device)).remainder(W)
            layer.keys.index_copy_(2, rows, window)
            if layer.step_kv is not None:  # step_kv's copy of the ring (its entries are views)
                layer.step_kv.index_copy_(1, rows, window[:, 0])
            for name, (entries, ring_kv, ring_gate) in state.items():
                layer.entries[name][:, : entries.shape[1]].copy_(entries)
                layer.ring_kv[name].copy_(ring_kv)  # position p in row p % (2 * rate): context is a multiple
                layer.ring_gate[name].copy_(ring_gate)
            layer.cumulative_length.fill_(context)
            continue
        layer.keys = window[:, :, 1:].contiguous()  # transformers keeps W - 1 rows between calls
        layer.values = layer.keys
        layer.cumulative_length = context
        for name, (entries, ring_kv, ring_gate) in state.items():
            module, rate = modules[name], modules[name].compress_rate
            layer.compressed_kv[name] = entries
            layer.entry_count[name] = entries.shape[1]
            layer.buffer_kv[name] = layer.buffer_gate[name] = None  # no open window: context is a multiple
            if hasattr(layer, "overlap_kv"):  # CSA: the last closed window's first half, gate with its bias
                dim = module.head_dim
                layer.overlap_kv[name] = ring_kv[:, rate:, :dim].clone()
                layer.overlap_gate[name] = ring_gate[:, rate:, :dim] + module.position_bias[:, :dim]


def _busy(device, seconds: float = 0.3) -> None:
    """Keep the GPU busy for a moment before timing: a few milliseconds of steps right after a compile
    (GPU idle, clocks down) measured up to 0.13 ms slower per step than the same steps later (H100)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def left_padding(batch: int, pad: int, device) -> torch.Tensor:
    """Leading padding tokens per sequence of a left-padded batch: 0 for the first (longest) sequence up to
    ``pad`` for the last, evenly spaced (a batch of prompts of different lengths, as ``generate`` pads them)."""
    return torch.tensor([(b * pad) // max(batch - 1, 1) for b in range(batch)], device=device)


@functools.cache
def _masks_cache_kwarg() -> str:
    from transformers import masking_utils

    params = inspect.signature(masking_utils.create_masks_for_generate).parameters
    return "cache" if "cache" in params else "past_key_values"  # transformers 5.24 / 5.17


def masks_for_generate(model, mask_2d: torch.Tensor, cache, position_ids: torch.Tensor):
    """The attention mask ``generate`` hands a decode step over a compileable (static) cache: made outside the
    (compiled) forward from the 2D padding mask, over the cache's whole length, so a graph sees one shape every
    step (a growing 2D mask given to the compiled forward would record a new CUDA graph per length)."""
    from transformers import masking_utils

    make = getattr(model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
    cache_kwarg = _masks_cache_kwarg()
    batch = mask_2d.shape[0]
    embeds = torch.empty((batch, 1, 0), dtype=model.dtype, device=mask_2d.device)  # shape and dtype only
    mask = make(config=model.config, inputs_embeds=embeds, attention_mask=mask_2d, position_ids=position_ids,
                **{cache_kwarg: cache})
    if isinstance(mask, dict):
        return {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in mask.items()}
    return mask.contiguous() if isinstance(mask, torch.Tensor) else mask


def decode_steps(model, mode: str, batch: int, context: int, steps: int, device, dtype, profile: bool = False,
                 pad: int = 0, step_kv: bool = True):
    """(ms per step, peak GiB, last hidden state of the first step). ``profile``: after the timed
    steps, print where the host time of 20 more goes (cProfile, by cumulative time) and the torch
    operators and kernel launches of one step (torch.profiler). ``pad`` > 0: a left-padded batch (see
    ``left_padding``): each step passes the attention mask ``generate`` passes (the 2D mask over the cache and the
    new token for a dynamic cache, ``masks_for_generate`` for a static one), and each sequence's positions start
    after its padding."""
    warm = 3
    cache = filled_cache(model, mode, batch, context, warm + steps + (23 if profile else 2), device, dtype, step_kv)
    forward = model.forward
    if mode == "compiled_static":
        torch._dynamo.reset()
        forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    kw = {_cache_kwarg(model): cache, "use_cache": True}
    tok = torch.randint(3, model.config.vocab_size, (batch, 1), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    first = None
    lead = left_padding(batch, pad, device) if pad else None
    if pad:  # [B, context + steps]: sequence b masks its first lead[b] cached tokens
        cols = warm + steps + (23 if profile else 2)
        full_mask = (torch.arange(context + cols, device=device)[None, :] >= lead[:, None]).long()

    def step(i):
        pos = torch.full((batch, 1), context + i, device=device, dtype=torch.long)
        if not pad:
            return forward(input_ids=tok, position_ids=pos, **kw).last_hidden_state
        pos = pos - lead[:, None]
        mask = full_mask[:, :context + i + 1]
        if mode != "eager_dynamic":  # a compileable cache: the mask is made before the forward, as generate does
            mask = masks_for_generate(model, mask, cache, pos)
        return forward(input_ids=tok, position_ids=pos, attention_mask=mask, **kw).last_hidden_state

    with torch.no_grad():
        for i in range(warm):
            out = step(i)
            if first is None:
                first = out.float().clone()
        if device.type == "cuda":
            _busy(device)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for i in range(warm, warm + steps):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        if profile and mode == "compiled_static":
            _print_gpu_profile(step, warm + steps, device)
        elif profile:
            _print_profile(step, warm + steps, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return ms, peak, first


def _print_gpu_profile(step, first: int, device, steps: int = 10) -> None:
    """The GPU time of each kernel over ``steps`` replayed steps (torch.profiler; a CUDA graph's kernels are
    listed one by one), and the GPU time per step: where a compiled step's time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    if device.type != "cuda":
        return
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as tp:
        for i in range(first, first + steps):
            step(i)
        torch.cuda.synchronize()
    events = [e for e in tp.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events) / steps
    print(f"GPU time per step (kernels, summed): {total_us:.1f} us over {steps} steps", flush=True)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"  {e.self_device_time_total / steps:8.1f} us/step  x{e.count // steps:<3} {e.key[:110]}", flush=True)
    # TileLang names every kernel main_kernel: the launch order of the last step tells them apart
    kernels = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    last = kernels[-max(1, len(kernels) // steps):]
    print("  last step, kernels in launch order (us): " + ", ".join(
        f"{e.name[:20]} {e.device_time:.1f}" for e in last), flush=True)


def _print_profile(step, first: int, device) -> None:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for i in range(first, first + 20):
        step(i)
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
    print("host time of 20 steps by cumulative time (cProfile):\n" + text.getvalue(), flush=True)
    from torch.profiler import ProfilerActivity, profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as tp:
        step(first + 20)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = tp.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC"))
    print(f"one step: {launches} kernel launches", flush=True)
    print(events.table(sort_by="self_cpu_time_total", row_limit=40), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # the V3.2 family, and DeepSeek-V4 (its static modes on the package's DsaV4StaticCache)
    parser.add_argument("--model", choices=sorted(DIMS), default="glm5")
    parser.add_argument("--contexts", default="4096,65536,131072")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", default="1", help="decoder layers, e.g. 1,4: the per-layer cost is the difference")
    parser.add_argument("--providers", default="dsa_tilelang,sdpa")
    parser.add_argument("--profile", action="store_true",
                        help="print the host-time profile of each eager case (cProfile, torch.profiler) and the GPU "
                             "time per kernel of each compiled one")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny dims, no result files")
    parser.add_argument("--fp8-index", choices=("off", "on", "both"), default="off",
                        help="dsa_tilelang with the opt-in fp8 index cache (on), or without and with it (both)")
    parser.add_argument("--v4-step-kv", choices=("off", "on", "both"), default="on",
                        help="DeepSeek-V4's static modes with DsaV4StaticCache(step_kv=True) (the default: a step "
                             "reads the window and the entries as one buffer), with step_kv=False (transformers "
                             "concatenates the cache each step; rows with variant concat_kv), or both")
    parser.add_argument("--left-pad", type=int, default=0,
                        help="B > 1: a left-padded batch, sequence b masking its first b * N / (B - 1) cached tokens "
                             "(rows with variant left_pad<N>)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")

    import dsa_plugins.hf
    from dsa_plugins.bench.runner import env_info, write_results

    dsa_plugins.hf.register()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    args.smoke = args.smoke or device.type == "cpu"
    contexts = [64] if args.smoke else [int(c) for c in args.contexts.split(",")]
    batches = [1, 2] if args.smoke else [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    if args.smoke:
        modes = [m for m in modes if m != "compiled_static"]  # inductor on two CPU cores: minutes
    dtype = torch.float32 if args.smoke else torch.bfloat16
    env = env_info(device)
    model_type = DIMS[args.model][0]
    depths = [int(n) for n in args.layers.split(",")]
    providers = args.providers.split(",")
    variants = {"off": [""], "on": ["fp8_index"], "both": ["", "fp8_index"]}[args.fp8_index]
    if args.model == "deepseek_v4":
        variants = {"on": [""], "off": ["concat_kv"], "both": ["", "concat_kv"]}[args.v4_step_kv]
    cases = []
    for layers in depths:
        if "dsa_tilelang" in providers:
            cases += [(c, b, m, "dsa_tilelang", layers, v) for v in variants for c in contexts for b in batches
                      for m in modes if not (v == "concat_kv" and m == "eager_dynamic")]  # (a static-cache option)
        if "sdpa" in providers:
            cases += [(c, 1, m, "sdpa", layers, "") for c in sorted({contexts[0], contexts[-1]}) for m in modes
                      if m != "eager_dynamic"]
        if "eager" in providers:  # transformers' eager attention (DeepSeek-V4's only path there), dynamic cache
            cases += [(c, 1, "eager_dynamic", "eager", layers, "") for c in sorted({contexts[0], contexts[-1]})]
    rows, models, firsts = [], {}, {}
    pad = min(args.left_pad, min(contexts) - 1)  # every sequence keeps a cached token
    for context, batch, mode, provider, layers, variant in cases:
        depth = f" L{layers}" if layers != 1 else ""
        shape = f"{'smoke' if args.smoke else args.model}{depth} B{batch} ctx{context}"
        shown = "+".join(v for v in (variant, f"left_pad{pad}" if pad else "") if v)
        row = {"op": f"hf_{model_type}_decode", "mode": mode, "shape": shape, "provider": provider,
               "variant": shown, **env}
        label = f"{provider}{'+' + shown if shown else ''}"
        try:
            if (provider, layers, variant) not in models:
                models.clear()
                model, _ = build_layer(args.model, provider, args.smoke, device, dtype, layers=layers)
                if variant == "fp8_index":
                    dsa_plugins.hf.enable_fp8_index_cache(model)
                models[provider, layers, variant] = model.eval()
            ms, peak, first = decode_steps(models[provider, layers, variant], mode, batch, context,
                                           2 if args.smoke else args.steps, device, dtype,
                                           profile=args.profile, pad=pad, step_kv=variant != "concat_kv")
            row.update(median_ms=ms, tokens_per_s=batch / ms * 1e3, peak_gib=peak)
            ref = firsts.setdefault((context, batch, provider, layers, variant), first)
            row["max_diff_vs_first_mode"] = float((first - ref).abs().max())
            # per sequence, relative to that sequence's largest value (a left-padded batch's first sequence is unpadded)
            rel = ((first - ref).abs().flatten(1).amax(1) / ref.abs().flatten(1).amax(1).clamp_min(1e-30)).tolist()
            print(f"{shape:<28} {label:<23} {mode:<16} {ms:8.3f} ms/step  {batch / ms * 1e3:9.0f} tok/s  "
                  f"peak {peak:6.2f} GiB  diff {row['max_diff_vs_first_mode']:.3g} (rel: first sequence {rel[0]:.2g},"
                  f" largest {max(rel):.2g})", flush=True)
        except Exception as exc:  # an out-of-memory or a compile failure is a row, not a crash
            row["error"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            print(f"{shape:<28} {label:<23} {mode:<16} {row['error']}", flush=True)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    for row in rows:  # B > 1: tokens/s over B 1's, same context and mode
        one = [r for r in rows if r["provider"] == row["provider"] and r["mode"] == row["mode"]
               and r["variant"] == row["variant"] and r["shape"] == re.sub(r"\bB\d+\b", "B1", row["shape"]) and "tokens_per_s" in r]
        if one and "tokens_per_s" in row and row is not one[0]:
            row["throughput_vs_B1"] = row["tokens_per_s"] / one[0]["tokens_per_s"]
    if not args.smoke:
        paths = write_results(rows, Path(args.out), f"hf_decode_{args.model}")
        print("results:", ", ".join(str(p) for p in paths if p))
    return 0 if all("error" not in r for r in rows if r["provider"] == "dsa_tilelang") else 1


if __name__ == "__main__":
    raise SystemExit(main())
