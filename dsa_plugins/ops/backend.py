"""Backend choice: "auto" | "tilelang" | "torch".

- "torch": always the reference path.
- "tilelang": the kernel, or a RuntimeError that says why it cannot run.
- "auto": the kernel when it can run, else the reference path with one warning per reason.
"""

from __future__ import annotations

import functools
import sys

import torch

from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from ..common.settings import resolve_backend, warn_once
from ..kernels import KERNEL_GROUPS, KERNELS, kernel_unavailable_reason, load_kernel


def autocast_floats(*tensors):
    """The tensors as an op under torch.autocast takes them: inside an autocast region of their device type,
    float32 ones cast to that region's dtype (as autocast does for SDPA and matmuls: the attention and
    indexer are matmul-like), the rest (and None) as they are; outside a region, unchanged. So a model
    trained with fp32 weights under bf16 mixed precision (accelerate, HF Trainer) runs the kernels."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)  # the ops' checks name bad inputs
    if first is None:
        return tensors
    try:
        enabled = torch.is_autocast_enabled(first.device.type)
    except RuntimeError:  # a device type without autocast (meta): nothing to cast
        return tensors
    if not enabled:
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t for t in tensors)


def direct_call_ok(*tensors) -> bool:
    """True when an op may call its custom op's body directly instead of going through the dispatcher:
    plain tensors or parameters (None allowed), no torch.compile / jit tracing, no dispatch or function mode in effect
    (FakeTensor, make_fx, export and FlopCounterMode all see the custom op). The body is what the custom
    op runs, so the results are the same; the dispatcher's own work costs about 40 us a call on the host,
    which an eager generation step pays per layer for the indexer and the attention."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or torch._C._is_torch_function_mode_enabled():
        return False
    if _current_dispatch_mode() is not None:
        return False
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def is_dsa_kernel_available(name: str) -> bool:
    """True when TileLang, the kernel code and a supported GPU are all present.

    ``name``: a kernel ("sparse_attention_fwd", "sparse_attention_bwd", "indexer_topk", "topk_rows")
    or an op group ("sparse_attention", "sparse_mla", "indexer", "topk").
    """
    if name not in KERNELS and name not in KERNEL_GROUPS:
        raise ValueError(f"unknown DSA kernel {name!r}; known: {sorted(KERNELS) + sorted(KERNEL_GROUPS)}")
    return kernel_unavailable_reason(name) is None


def should_use_tilelang(
    backend: str | None,
    available: bool,
    kernel_name: str,
    tensors: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    require_bf16: bool = False,
) -> bool:
    """Decide kernel vs reference for one call (the NeMo AutoModel helper's contract).

    ``available``: the caller's own knowledge that the kernel exists (False forces the fallback).
    Raises RuntimeError for backend="tilelang" when the kernel cannot run on ``tensors``.
    """
    backend = resolve_backend(backend)
    if backend == "torch":
        return False
    reason = None if available else f"the {kernel_name} kernel is not available"
    if reason is None:
        group = kernel_name if kernel_name in KERNELS or kernel_name in KERNEL_GROUPS else None
        reason = kernel_unavailable_reason(group, tuple(tensors)) if group else None
        if reason is None and not group:
            reason = next((r for r in (_cuda_reason(t) for t in tensors) if r), None)
    if reason is None and require_bf16:
        bad = [t for t in tensors if t.is_floating_point() and t.dtype != torch.bfloat16]
        if bad:
            reason = f"the {kernel_name} kernel needs bfloat16 inputs, got {str(bad[0].dtype).replace('torch.', '')}"
    return _decide(backend, kernel_name, reason)


def _cuda_reason(t: torch.Tensor) -> str | None:
    return None if t.is_cuda else f"inputs are on {t.device.type}, the kernels need CUDA tensors"


def _decide(backend: str, kernel_name: str, reason: str | None) -> bool:
    if reason is None:
        return True
    if backend == "tilelang":
        raise RuntimeError(
            f"dsa_plugins: backend='tilelang' was requested for {kernel_name}, but it cannot run: {reason}. "
            "Use backend='auto' to fall back to the torch reference, or 'torch' to always use it."
        )
    warn_once(
        f"fallback:{kernel_name}:{reason}",
        f"dsa_plugins: {kernel_name} runs on the torch reference path ({reason}).",
    )
    return False


def kernel_shape_reason(kernel_name: str, **config) -> str | None:
    """The kernel module's own ``unsupported_reason(**config)`` (heads, dims, dtype...), or None
    when the kernel code is missing (reported elsewhere) or has no such check. Asked on every op call
    with a handful of sizes and a dtype: answered once per distinct question."""
    return _shape_reason(kernel_name, tuple(sorted(config.items())))


@functools.lru_cache(maxsize=1024)
def _shape_reason(kernel_name: str, config: tuple) -> str | None:
    try:
        fn = load_kernel(kernel_name)
    except Exception:
        return None
    check = getattr(sys.modules[fn.__module__], "unsupported_reason", None)
    return None if check is None else check(**dict(config))


def choose_kernel(backend: str | None, kernel_name: str, tensors: tuple[torch.Tensor, ...], extra_reason: str | None = None) -> bool:
    """Internal form of should_use_tilelang: ``extra_reason`` is a shape the kernel does not support."""
    backend = resolve_backend(backend)
    if backend == "torch":
        return False
    reason = kernel_unavailable_reason(kernel_name, tensors) or extra_reason
    return _decide(backend, kernel_name, reason)
