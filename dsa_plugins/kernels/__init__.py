"""TileLang programs, one module per kernel family, and what it takes to run them.

TileLang is imported lazily: ``import dsa_plugins`` works without it or without a GPU, and
:func:`kernel_unavailable_reason` says why a kernel cannot run on given inputs.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass

import torch

from ..common.settings import warn_once

# Hopper (sm_90 / sm_90a) is the architecture the kernels are written and tested for.
SUPPORTED_CAPABILITIES = ((9, 0),)
CPU_COMPILE_TARGET = {"kind": "cuda", "arch": "sm_90a"}


@dataclass(frozen=True)
class KernelSpec:
    """A public kernel: the module that holds its wrapper and the wrapper's name."""

    name: str
    module: str
    function: str
    dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)


_HALF = (torch.bfloat16, torch.float16)

KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec("sparse_attention_fwd", "dsa_plugins.kernels.sparse_attention_fwd", "sparse_attention_fwd", _HALF),
        KernelSpec("sparse_attention_bwd", "dsa_plugins.kernels.sparse_attention_bwd", "sparse_attention_bwd", _HALF),
        KernelSpec("indexer_topk", "dsa_plugins.kernels.indexer", "indexer_topk",
                   (torch.bfloat16, torch.float8_e4m3fn)),
        KernelSpec("topk_rows", "dsa_plugins.kernels.topk", "topk_rows", (torch.float32,)),
        KernelSpec("indexer_kl_loss", "dsa_plugins.kernels.indexer_loss", "indexer_kl_loss_sparse"),
        KernelSpec("indexer_kl_loss_dense", "dsa_plugins.kernels.indexer_loss", "indexer_kl_loss_dense"),
    )
}

# Names accepted by is_dsa_kernel_available() besides the kernel names: groups of kernels that
# an op needs together.
KERNEL_GROUPS: dict[str, tuple[str, ...]] = {
    "sparse_attention": ("sparse_attention_fwd", "sparse_attention_bwd"),
    "sparse_mla": ("sparse_attention_fwd", "sparse_attention_bwd"),
    "indexer": ("indexer_topk",),
    "topk": ("topk_rows",),
    "indexer_loss": ("indexer_kl_loss", "indexer_kl_loss_dense"),
}


def aligned_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous, copied when its base is not 16-byte aligned: the programs read their operands by TMA,
    cp.async and 16-byte vector loads, which need that (a contiguous view may start at any element of its
    storage)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def aligned_output(t: torch.Tensor, *, keep: bool = False) -> torch.Tensor:
    """The buffer a program writes for the caller's contiguous ``t``: ``t`` itself when its base is 16-byte aligned,
    else a new aligned one (holding ``t``'s values with ``keep``: the program adds to them) that the caller copies
    back into ``t`` (TMA stores, 16-byte stores and v4 reductions fault on a misaligned base)."""
    if t.data_ptr() % 16 == 0:
        return t
    return t.clone() if keep else torch.empty_like(t)


def zeros_arg(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A [n] zero tensor for a program argument the compiled variant does not read (or reads as
    zeros). Made per call, never cached: a tensor kept from a first call made inside
    torch.compile's CUDA-graph warm-up lives in the graph's memory pool, which the graph then
    refuses ("tensor(s) in the cudagraph pool not tracked as outputs"); the per-call memset is
    about a microsecond."""
    return torch.zeros(n, dtype=dtype, device=device)


def unread_arg(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A [n] tensor for a program argument the compiled variant never reads (a sink without sinks, an
    lse the program does not write): uninitialised, so no fill is launched. Made per call, like
    :func:`zeros_arg`, for the same CUDA-graph reason."""
    return torch.empty(n, dtype=dtype, device=device)


def target_key(target):
    """A hashable cache key for a compile target (a dict such as CPU_COMPILE_TARGET, or a string)."""
    return tuple(sorted(target.items())) if isinstance(target, dict) else target


def announce_compile(what: str) -> None:
    """Say once per process that kernels are being built (the first calls would otherwise be
    silent for up to a minute per configuration), and how to do it ahead."""
    warn_once(
        "kernels:compile",
        f"dsa_plugins: building TileLang kernels on first use ({what} first): a compile of seconds to a minute "
        "per configuration unless TileLang's disk cache holds it; `python -m dsa_plugins warmup MODEL` compiles "
        "them ahead, INFO logs on the 'dsa_plugins' logger name each one",
    )


@functools.lru_cache(maxsize=None)
def tilelang_import_error() -> str | None:
    """None when TileLang imports, else the reason it does not."""
    try:
        importlib.import_module("tilelang")
    except Exception as exc:  # ImportError, or a broken native library
        return f"TileLang is not importable ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def load_kernel(name: str):
    """The wrapper function of kernel ``name``; raises ImportError/AttributeError if it is missing."""
    spec = KERNELS[name]
    return getattr(importlib.import_module(spec.module), spec.function)


@functools.lru_cache(maxsize=None)
def _kernel_code_error(name: str) -> str | None:
    try:
        load_kernel(name)
    except Exception as exc:
        return f"kernel {name!r} is not available in this build ({type(exc).__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=None)
def _device_error(index: int) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    cap = torch.cuda.get_device_capability(index)
    if cap not in SUPPORTED_CAPABILITIES:
        name = torch.cuda.get_device_name(index)
        return f"GPU {name} has compute capability {cap[0]}.{cap[1]}; the TileLang kernels need Hopper (9.0)"
    return None


def device_unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why kernels cannot run on ``device`` (default: the current CUDA device), or None."""
    if device is not None and device.type != "cuda":
        return f"inputs are on {device.type}, the TileLang kernels need CUDA tensors"
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _device_error(index)


def kernel_unavailable_reason(name: str, tensors: tuple[torch.Tensor, ...] = ()) -> str | None:
    """None if kernel (or kernel group) ``name`` can run on ``tensors``, else a one-line reason."""
    names = KERNEL_GROUPS.get(name, (name,))
    for kernel in names:
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; known: {sorted(KERNELS) + sorted(KERNEL_GROUPS)}")
    # cheapest first: the device, then TileLang (an import of seconds), then the kernel code
    reason = device_unavailable_reason(tensors[0].device if tensors else None)
    if reason:
        return reason
    reason = tilelang_import_error()
    if reason:
        return reason
    for kernel in names:
        reason = _kernel_code_error(kernel)
        if reason:
            return reason
    allowed = KERNELS[names[0]].dtypes
    for t in tensors:
        if t.is_floating_point() and t.dtype not in allowed:
            want = ", ".join(str(d).replace("torch.", "") for d in allowed)
            return f"the {name} kernel takes {want} inputs, got {str(t.dtype).replace('torch.', '')}"
    return None


def compiled_once(cache: dict, lock, key, what: str, build):
    """``cache[key]``, built by ``build()`` on the first request after announcing the compile of ``what``.
    Builds that share ``lock`` (each kernel family holds its own) run one at a time, so a program is built
    once however many threads ask for it; TileLang's disk cache serves later processes."""
    prog = cache.get(key)
    if prog is not None:
        return prog
    with lock:
        prog = cache.get(key)
        if prog is None:
            announce_compile(what)
            prog = cache[key] = build()
    return prog
