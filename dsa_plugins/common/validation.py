"""Input checks that name the tensor and what was expected.

Cheap checks (dtype, rank, shape, device, strides) always run; the full index-range check is
opt-in (``DSA_PLUGINS_CHECK_INDICES=1``) because it needs a device->host sync.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn,)  # the fp8 indexer's q/k (inference)


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Iterable[int] | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    shape: dict[int, int] | None = None,
    unit_stride: bool = True,
) -> torch.Tensor:
    """Raise ValueError unless ``t`` is a tensor with the given rank, dtype, device and sizes.

    ``shape`` maps a dimension to its required size (negative dims allowed). ``unit_stride``: the
    last dimension must be contiguous (the kernels read rows with vector loads); small index
    tensors that the op copies anyway pass False.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(str(n) for n in allowed)
            raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{name} must have dtype in ({want}), got {_describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of q), got {_describe(t)}")
    if shape:
        for dim, size in shape.items():
            if t.shape[dim] != size:
                raise ValueError(f"{name} must have size {size} in dimension {dim}, got shape {tuple(t.shape)}")
    # the stride first: inside a compiled graph a size may depend on the data, and asking it would fail
    if unit_stride and t.dim() > 0 and t.stride(-1) != 1 and t.numel() > 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def output_buffer(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device, *, zeros: bool = False) -> torch.Tensor:
    """A new tensor of ``shape`` (zero-filled with ``zeros``), or ``t`` after checking that a kernel
    can write it: that shape, dtype and device, contiguous (the kernels write flat rows)."""
    if t is None:
        return (torch.zeros if zeros else torch.empty)(shape, dtype=dtype, device=device)
    check_tensor(name, t, ndim=len(shape), dtypes=(dtype,), device=device,
                 shape=dict(enumerate(shape)))
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernel writes it in place), got strides {t.stride()}")
    return t


def check_scale(scale: object, name: str = "scale") -> float:
    if isinstance(scale, torch.Tensor):
        raise ValueError(f"{name} must be a Python float, got a tensor")
    try:
        value = float(scale)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive finite float, got {scale!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite float, got {scale!r}")
    return value


def check_index_range(name: str, indices: torch.Tensor, upper: int) -> None:
    """Full range check: every entry must be -1 or in [0, upper). Syncs with the device."""
    bad = (indices < -1) | (indices >= upper)
    count = int(bad.sum().item())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(
            f"{name} has {count} entries outside [-1, {upper}) (first at position {first}: "
            f"{int(indices[first].item())}); DSA_PLUGINS_CHECK_INDICES=1 rejects them "
            "(without it they are treated as 'no key')"
        )
