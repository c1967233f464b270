"""How far each query row's valid slots reach (``skip_tail``): the device scan the kernels share, and a
program that counts every row's blocks in one launch.

Causal rows and the first tokens of packed sequences hold -1 after their few keys, so the attention kernels
stop a row at its last valid slot. ``ROW_SCAN_PRELUDE`` is CUDA source for a program's prelude: each of the
CTA's ``kThreads`` threads reads every ``kThreads``-th slot of the row (coalesced) and keeps the largest
(slot + 1) holding an entry >= 0; each warp's maximum goes to ``last_w[warp]``; after the CTA's barrier any
thread takes the largest of them, rounded up to whole blocks. The backward's CTAs scan their own row (they
load q and dout meanwhile); the forward takes the counts from :func:`row_blocks_cuda` before its launch
(a scan inside the forward's CTAs held the producer's first gathers until the row's indices arrived: slower,
``fwd_fixed_cost_h100.md``). Entries past the keys count as valid here: they are masked in the walk, so a
block more of them changes no bit.

TileLang is imported lazily: the module imports without TileLang or a GPU.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations

import logging
import threading

import torch
from torch import Tensor

from . import compiled_once, target_key

__all__ = ["ROW_SCAN_PRELUDE", "ROW_SCAN_THREADS", "build_row_blocks", "row_blocks_cuda"]

logger = logging.getLogger("dsa_plugins")

ROW_SCAN_PRELUDE = r"""
template <int kThreads>
__device__ __forceinline__ void dsa_row_last_scan(const int* row, int kp, int* last_w) {
  int last = 0;
  for (int j = threadIdx.x; j < kp; j += kThreads) last = row[j] >= 0 ? j + 1 : last;
  last = __reduce_max_sync(0xffffffffu, last);
  if ((threadIdx.x & 31) == 0) last_w[threadIdx.x >> 5] = last;
}
template <int kThreads>
__device__ __forceinline__ int dsa_row_blocks(const int* last_w, int block) {
  int last = last_w[0];
  #pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) last = max(last, last_w[w]);
  return (last + block - 1) / block;
}
"""

#: threads per row of the counting program (a row of 2048 slots: 16 coalesced loads per thread)
ROW_SCAN_THREADS = 128


def row_blocks_body():
    """The TileLang program: Idx [R, K] int32 (any R, K) -> Out [R] int32, the blocks of ``block`` slots
    each row walks to reach its last entry >= 0 (0 for a row without one). One CTA per row."""
    import tilelang.language as T

    R, K = T.dynamic("rows, slots")
    threads = ROW_SCAN_THREADS

    @T.prim_func
    def dsa_row_blocks(Idx: T.Tensor([R, K], "int32"), Out: T.Tensor([R], "int32"), block: T.int32):
        with T.Kernel(R, threads=threads, prelude=ROW_SCAN_PRELUDE) as bx:
            last_w = T.alloc_shared([threads // 32], "int32")
            T.call_extern("handle", f"dsa_row_last_scan<{threads}>", T.address_of(Idx[bx, 0]), K,
                          T.address_of(last_w[0]))
            T.sync_threads()
            if T.get_thread_binding() == 0:
                Out[bx] = T.call_extern("int32", f"dsa_row_blocks<{threads}>", T.address_of(last_w[0]), block)

    return dsa_row_blocks


_COMPILED: dict = {}
_LOCK = threading.Lock()


def build_row_blocks(target="auto"):
    """The compiled counting program (:func:`row_blocks_body`); cached per process and target."""
    import tilelang

    def build():
        prog = tilelang.jit(target=target)(row_blocks_body)()
        logger.info("dsa_plugins: compiled the row block counts for %s", target)
        return prog

    return compiled_once(_COMPILED, _LOCK, target_key(target), "row block counts", build)


def row_blocks_cuda(indices: Tensor, block: int, target="auto") -> Tensor:
    """[R, K] int32 CUDA indices (K >= 1; made contiguous here) -> [R] int32: the blocks of ``block`` slots
    each row walks to reach its last entry >= 0, in one launch (``common.indices.row_blocks`` with
    n_keys=None)."""
    if int(block) < 1:
        raise ValueError(f"row_blocks_cuda: block must be >= 1, got {block}")
    if indices.dim() != 2 or indices.dtype != torch.int32 or not indices.is_cuda or indices.shape[1] == 0:
        raise ValueError(f"row_blocks_cuda: indices must be a [R, K >= 1] int32 CUDA tensor, got "
                         f"{tuple(indices.shape)} {indices.dtype} on {indices.device}")
    if indices.numel() >= 2**31:  # the program's offsets are 32-bit
        raise ValueError(f"row_blocks_cuda: indices must hold fewer than 2**31 entries, got {indices.numel()}")
    out = torch.empty(indices.shape[0], dtype=torch.int32, device=indices.device)
    if indices.shape[0]:
        build_row_blocks(target)(indices.contiguous(), out, int(block))
    return out
