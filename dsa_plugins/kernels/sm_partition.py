"""Two CUDA streams whose kernels run on disjoint sets of a GPU's SMs (CUDA green contexts, driver 12.4+).

The deterministic backward uses them to reduce one chunk's contribution rows on a few SMs while the next
chunk's main program runs on the others (``det_overlap_sms``): the main program is bound by L2 and leaves
HBM mostly idle, the reduce is one HBM pass. Without the split the two would take turns on the whole GPU
(neither leaves room on an SM for the other's CTAs).

The driver's resource API splits the device's SM resource into a group of at least ``small`` SMs and the
remainder, and makes a green context and a stream of each (``cuDevSmResourceSplitByCount``,
``cuGreenCtxCreate``, ``cuGreenCtxStreamCreate``). Kernels launched through the runtime API into those
streams (torch's and TileLang's) run on that context's SMs; :meth:`Partition.use` also makes the green context
the thread's current one while they are launched (as torch's ``GreenContext.make_current`` does). torch's own
``GreenContext`` takes the first SMs of the device for each context, so two of them overlap; hence the driver
calls here, through ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["Partition", "PartitionUnavailable", "split_streams"]

# sizeof(CUdevResource) in the driver's resource ABI version 1 (CUDA 12.4 to 13.x): the type (4 bytes), 92 bytes
# of padding, a 48-byte union whose SM member starts with smCount
_RESOURCE_BYTES = 144
_SM_COUNT_OFFSET = 96
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 1
_CU_STREAM_NON_BLOCKING = 1
_MIN_DRIVER = 12040


class PartitionUnavailable(RuntimeError):
    """The driver, the device or this process cannot split the SMs (no libcuda, a driver before 12.4, ...)."""


@dataclass(frozen=True)
class Partition:
    """``small`` / ``large``: streams on ``small_sms`` / ``large_sms`` SMs of one device, disjoint."""

    small: torch.cuda.Stream
    large: torch.cuda.Stream
    small_sms: int
    large_sms: int
    _contexts: dict = field(default_factory=dict, repr=False)  # id(stream) -> its green context as a CUcontext

    @contextlib.contextmanager
    def use(self, stream: torch.cuda.Stream):
        """Launch into ``stream`` (``small`` or ``large``): its green context current and it the current stream."""
        cu = _driver()
        _call(cu, "cuCtxPushCurrent", self._contexts[id(stream)])
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            popped = ctypes.c_void_p()
            _call(cu, "cuCtxPopCurrent", ctypes.byref(popped))


_LOCK = threading.Lock()
_CACHE: dict = {}


@dataclass(frozen=True)
class _Driver:
    functions: dict  # name (as cuda.h spells it) -> the library's function, typed


_DRIVER = None


def _driver():
    global _DRIVER
    if _DRIVER is not None:
        return _DRIVER
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise PartitionUnavailable(f"no CUDA driver library ({exc})") from exc
    vp, ui, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    signatures = {
        "cuDriverGetVersion": [ctypes.POINTER(i)],
        "cuDeviceGet": [ctypes.POINTER(i), i],
        "cuDeviceGetDevResource": [i, vp, i],
        "cuDevSmResourceSplitByCount": [vp, ctypes.POINTER(ui), vp, vp, ui, ui],
        "cuDevResourceGenerateDesc": [ctypes.POINTER(vp), vp, ui],
        "cuGreenCtxCreate": [ctypes.POINTER(vp), vp, i, ui],
        "cuGreenCtxStreamCreate": [ctypes.POINTER(vp), vp, ui, i],
        "cuCtxFromGreenCtx": [ctypes.POINTER(vp), vp],
        "cuCtxPushCurrent": [vp],
        "cuCtxPopCurrent": [ctypes.POINTER(vp)],
        "cuGetErrorString": [i, ctypes.POINTER(ctypes.c_char_p)],
    }
    # cuda.h maps these names to versioned symbols; the plain ones in the library are the old ABI
    versioned = {"cuCtxPushCurrent": "cuCtxPushCurrent_v2", "cuCtxPopCurrent": "cuCtxPopCurrent_v2"}
    functions = {}
    for name, args in signatures.items():
        fn = getattr(cu, versioned.get(name, name), None)
        if fn is None:
            raise PartitionUnavailable(f"the CUDA driver has no {name} (green contexts need driver 12.4+)")
        fn.argtypes, fn.restype = args, ctypes.c_int
        functions[name] = fn
    _DRIVER = _Driver(functions)
    return _DRIVER


def _call(cu, name: str, *args) -> None:
    rc = cu.functions[name](*args)
    if rc != 0:
        msg = ctypes.c_char_p()
        cu.functions["cuGetErrorString"](rc, ctypes.byref(msg))
        raise PartitionUnavailable(f"{name} failed: {rc} ({(msg.value or b'?').decode()})")


def _stream(cu, dev: ctypes.c_int, resource, device: torch.device):
    """(a stream of a new green context on ``resource``, that context as a CUcontext)."""
    desc, green, ctx, stream = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    _call(cu, "cuDevResourceGenerateDesc", ctypes.byref(desc), resource, 1)
    _call(cu, "cuGreenCtxCreate", ctypes.byref(green), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM)
    _call(cu, "cuCtxFromGreenCtx", ctypes.byref(ctx), green)
    _call(cu, "cuGreenCtxStreamCreate", ctypes.byref(stream), green, _CU_STREAM_NON_BLOCKING, 0)
    # the contexts and the streams live as long as the process (cached below)
    return torch.cuda.ExternalStream(stream.value, device=device), ctx


def split_streams(device: torch.device | int, small: int) -> Partition:
    """Streams on at least ``small`` SMs of ``device`` and on the rest (the driver rounds ``small`` up to its
    partition granularity); made once per (device, small) and kept. Raises :class:`PartitionUnavailable`."""
    device = torch.device("cuda", device) if isinstance(device, int) else device
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, int(small))
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        if small <= 0:
            raise PartitionUnavailable(f"the small group needs at least one SM, got {small}")
        cu = _driver()
        version = ctypes.c_int()
        _call(cu, "cuDriverGetVersion", ctypes.byref(version))
        if version.value < _MIN_DRIVER:
            raise PartitionUnavailable(f"green contexts need CUDA driver 12.4+, this one is {version.value}")
        torch.empty(1, device=torch.device("cuda", index))  # the primary context exists before the green ones
        dev = ctypes.c_int()
        _call(cu, "cuDeviceGet", ctypes.byref(dev), index)
        whole = (ctypes.c_ubyte * _RESOURCE_BYTES)()
        group = (ctypes.c_ubyte * _RESOURCE_BYTES)()
        rest = (ctypes.c_ubyte * _RESOURCE_BYTES)()
        _call(cu, "cuDeviceGetDevResource", dev, whole, _CU_DEV_RESOURCE_TYPE_SM)
        n_groups = ctypes.c_uint(1)
        _call(cu, "cuDevSmResourceSplitByCount", group, ctypes.byref(n_groups), whole, rest, 0, int(small))

        def sms(res) -> int:
            return int.from_bytes(bytes(res[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4]), "little")

        if n_groups.value != 1 or sms(rest) == 0:
            raise PartitionUnavailable(f"could not split {sms(whole)} SMs into {small} and the rest")
        (small_s, small_ctx), (large_s, large_ctx) = (_stream(cu, dev, res, torch.device("cuda", index))
                                                      for res in (group, rest))
        part = Partition(small_s, large_s, sms(group), sms(rest), {id(small_s): small_ctx, id(large_s): large_ctx})
        _CACHE[key] = part
        return part
