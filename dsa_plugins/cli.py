"""``python -m dsa_plugins doctor | demo | bench | convert | warmup``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import sys

PACKAGES = ("torch", "tilelang", "transformers", "accelerate", "megatron-core", "safetensors")
OPS = (
    ("sparse_attention", "sparse_attention_fwd + sparse_attention_bwd"),
    ("indexer", "indexer_topk"),
    ("topk", "topk_rows"),
    ("indexer_loss", "indexer_kl_loss, sparse; fused into the attention backward with FusedIndexerLoss"),
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor(_args=None) -> int:
    """Print versions, the GPU, which path every op takes per backend, and the adapters."""
    import torch

    from . import __version__
    from .common.settings import autoload_enabled, default_backend, deterministic_enabled, deterministic_mode
    from .adapters import discover_adapters
    from .kernels import device_unavailable_reason, kernel_unavailable_reason

    print(f"dsa_plugins {__version__}  (python {sys.version.split()[0]})")
    for dist in PACKAGES:
        print(f"  {dist:<14} {_version(dist)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {cap[0]}.{cap[1]}")
    else:
        print("GPU: none (CUDA not available)")
    gpu_reason = device_unavailable_reason()
    print(f"default backend (DSA_PLUGINS_BACKEND): {default_backend()}")
    print("ops on CUDA bf16 inputs, by backend:")
    for name, kernels in OPS:
        reason = gpu_reason or kernel_unavailable_reason(name)
        auto = f"TileLang kernel ({kernels})" if reason is None else f"torch reference ({reason})"
        forced = "TileLang kernel" if reason is None else "error"
        print(f"  {name:<17} auto: {auto}; tilelang: {forced}; torch: torch reference")
    det = f"on, mode {deterministic_mode() or 'default'}" if deterministic_enabled() else "off"
    print(f"deterministic backward (DSA_PLUGINS_DETERMINISTIC): {det}")
    print(f"autoload at import torch (DSA_PLUGINS_AUTOLOAD): {'on' if autoload_enabled() else 'off'}")
    eps = [ep for ep in importlib.metadata.entry_points(group="torch.backends") if ep.name == "dsa_plugins"]
    print(f"  torch.backends entry point: {'installed' if eps else 'missing (pip install the package)'}")
    adapters = discover_adapters()
    if not adapters:
        print("adapters: none found")
    for name, adapter in sorted(adapters.items()):
        framework = adapter.trigger
        present = importlib.util.find_spec(framework.split(".")[0]) is not None
        try:
            state = "registered" if adapter.is_registered() else "not registered yet"
        except Exception as exc:  # a broken adapter is reported, not fatal
            state = f"error: {exc}"
        avail = "" if present else f" ({framework} not installed)"
        print(f"  adapter {name:<12} trigger {framework:<14} {state}{avail}")
    return 0


def _delegate(module: str, argv: list[str]) -> int:
    return int(importlib.import_module(module).main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_plugins", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="versions, GPU, which kernels run for which backend, adapters")
    sub.add_parser("demo", help="tiny GLM-5 and DeepSeek-V4 models: plugin vs eager (see README)", add_help=False)
    sub.add_parser("bench", help="benchmark the ops over a shape table (see benchmarks/)", add_help=False)
    sub.add_parser("convert", help="HF <-> Megatron checkpoint conversion", add_help=False)
    sub.add_parser("warmup", help="compile the kernels a model needs, in parallel, into the disk cache",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    args, rest = parser.parse_known_args(argv)
    if args.command == "doctor":
        return doctor(args)
    target = {"demo": "dsa_plugins.demo", "bench": "dsa_plugins.bench.suites", "convert": "dsa_plugins.convert",
              "warmup": "dsa_plugins.warmup"}
    return _delegate(target[args.command], rest)


if __name__ == "__main__":
    sys.exit(main())
