"""Where an eager generation step's host time goes: one GLM-5-dims Hugging Face layer under dsa_tilelang,
timed per function (the layer, the attention module, the indexer and our ops down to the kernel wrappers).

    python benchmarks/profile_hf_decode_host.py                      # GPU: B 1, 4K cache, eager_static
    python benchmarks/profile_hf_decode_host.py --context 131072 --mode eager_dynamic

An eager step is bound by host time (the GPU work of a decode step of one layer is tens of microseconds),
so each function's wall time between entry and return is its host cost. The functions are wrapped with
``time.perf_counter`` (nested times are inclusive), 20 warm steps, then ``--steps`` timed ones. The
device's host speed drifts between processes: compare two versions in alternating processes
(``benchmarks/results/hf_decode_glm5.md``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_hf_decode import _cache_kwarg, filled_cache  # noqa: E402
from bench_hf_layer import build_layer  # noqa: E402

# (module, attribute path, label): indented by nesting
TARGETS = [
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaDecoderLayer.forward", "layer"),
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaAttention.forward", " attention module"),
    ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaIndexer.forward", "  indexer module"),
    ("dsa_plugins.adapters.hf.models.v32_family", "select_topk", "   select_topk"),
    ("dsa_plugins.adapters.hf.masks", "LazyMask.windows", "    mask windows"),
    ("dsa_plugins.ops.indexer", "_packed_indexer_topk", "    ops: indexer_topk (packed)"),
    ("dsa_plugins.ops.indexer", "_run_indexer_topk", "     op body"),
    ("dsa_plugins.kernels.indexer", "_Plan.__init__", "      kernel plan"),
    ("dsa_plugins.kernels.indexer", "_Plan.chunk_scores", "      scores launch"),
    ("dsa_plugins.kernels.indexer", "_Plan.chunk_topk", "      top-k launches"),
    ("dsa_plugins.adapters.hf.attention", "absorbed_mla_forward", "  absorbed MLA"),
    ("dsa_plugins.ops.sparse_attention", "attention_forward", "   op body (direct)"),
    ("dsa_plugins.ops.attention_custom_ops", "attention_forward", "   op body (custom op)"),
    ("dsa_plugins.kernels.sparse_attention_fwd", "_launch", "    kernel launch"),
]


def _wrap(totals, counts, module_name: str, path: str, label: str) -> bool:
    owner = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    fn = getattr(owner, name, None)
    if fn is None:
        return False

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - t0
            counts[label] += 1

    setattr(owner, name, timed)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mode", choices=("eager_static", "eager_dynamic"), default="eager_static")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        print("profile_hf_decode_host: needs a CUDA GPU (host time of the kernels' launches)")
        return 2
    import dsa_plugins.hf

    dsa_plugins.hf.register()
    device, dtype = torch.device("cuda"), torch.bfloat16
    model, _ = build_layer("glm5", "dsa_tilelang", False, device, dtype)
    model.eval()
    totals, counts = collections.defaultdict(float), collections.Counter()
    wrapped = [t for t in TARGETS if _wrap(totals, counts, *t)]
    warm = 20
    cache = filled_cache(model, args.mode, args.batch, args.context, warm + args.steps + 2, device, dtype)
    kw = {_cache_kwarg(model): cache, "use_cache": True}
    tok = torch.randint(3, model.config.vocab_size, (args.batch, 1), device=device)

    def step(i):
        pos = torch.full((args.batch, 1), args.context + i, device=device, dtype=torch.long)
        return model(input_ids=tok, position_ids=pos, **kw).last_hidden_state

    with torch.no_grad():
        for i in range(warm):
            step(i)
        torch.cuda.synchronize()
        totals.clear()
        counts.clear()
        t0 = time.perf_counter()
        for i in range(warm, warm + args.steps):
            step(i)
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t0) / args.steps
    print(f"ctx {args.context} B{args.batch} {args.mode}: {per_step * 1e3:.3f} ms/step")
    for _, _, label in wrapped:
        if counts[label]:
            print(f"{label:<36} {totals[label] / args.steps * 1e6:8.1f} us/step  ({counts[label] // args.steps} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
