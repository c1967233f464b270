"""Deterministic sums of per-slot contribution rows (DSA.md 3, deterministic mode): the slot order and the
reduce program that the kernels' deterministic paths share.

A deterministic backward cannot let the slots that name one row (a kv row of the attention, an index_k row
of the indexer loss) add into it with atomics: the order of fp32 additions would follow the timing. Instead
the program stores each slot's contribution in a row of its own; :func:`slot_order` sorts the slots by the
row they name (stable: ties in slot order), and the reduce program sums each row's contributions in that
order. The sort depends on the indices only, so :func:`slot_order_async` runs it on a side stream while the
program that writes the contributions runs.

Users: the attention backward (``sparse_attention_bwd``: dkv, 576 / 512 columns, fp32 / bf16 / int16 rows)
and the indexer loss (``indexer_loss``: d_index_k, 128 columns, fp32 rows).

TileLang is imported lazily: the module imports without TileLang or a GPU.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations

import logging
import os
import threading

import torch
from torch import Tensor

from . import compiled_once, target_key

__all__ = ["DET_BUDGET_BYTES", "build_reduce", "chunk_rows", "keys_last_invalid", "reduce_body",
           "slot_order", "slot_order_async"]

logger = logging.getLogger("dsa_plugins")

#: Byte budget of one contribution buffer: callers run their query rows in chunks that fit it. 8 GB measured
#: 2-5% faster than 2 GB on the attention backward's deterministic mode (fewer chunks; H100, B1 S4096,
#: ``bwd_ws_h100.md``), not worth that much transient memory by default.
DET_BUDGET_BYTES = int(os.environ.get("DSA_PLUGINS_BWD_DET_BUDGET_MB", "2048")) * (1 << 20)


def chunk_rows(rows: int, per_row: int, budget: int) -> int:
    """Query rows per chunk of a contribution buffer of at most ``budget`` bytes, ``per_row`` bytes a row (at
    least 1; at most ``rows`` where there are any). Fewer, larger chunks are faster: each chunk costs a main
    program's ramp and a reduce's launch (chunks rounded down to whole 132-CTA waves, one more chunk at MLA H64,
    measured 1.4-2.6% slower; ``bwd_ws_h100.md``)."""
    return max(1, min(rows, budget // per_row))


def keys_last_invalid(idx: Tensor, n_rows: int) -> Tensor:
    """The flattened kv rows of ``idx`` [T, Kp] int32 with invalid slots (-1) as ``n_rows``: one past the
    last row, so they count (and sort) after every real one."""
    return torch.where(idx >= 0, idx, n_rows).reshape(-1)


_SIDE_STREAMS: dict = {}


def slot_order(idx: Tensor, n_rows: int, kp: int, nhb: int, rows: Tensor, rowptr: Tensor) -> None:
    """The reduce's slot order (:func:`reduce_body`), written into ``rows`` [T * Kp] int32 (each slot's first contribution
    row, of group 0 of the ``nhb`` groups a query row stores (head blocks, or their pairs), sorted by kv row, ties in slot
    order) and ``rowptr`` [n_rows + 1] int32 (where each kv row's
    slots start). Invalid slots sort last and no RowPtr range reaches them."""
    keys = keys_last_invalid(idx, n_rows)
    # int16 keys where every kv row (and the invalid key n_rows) fits: a radix sort of half the passes, the same
    # stable order (H100: 1.01-1.02x the deterministic backward, ab_bwd_patch.py slot_keys_i16, 2026-11-28)
    if n_rows <= torch.iinfo(torch.int16).max:
        keys = keys.to(torch.int16)
    sorted_keys, order = torch.sort(keys, stable=True)
    torch.searchsorted(sorted_keys, torch.arange(n_rows + 1, device=idx.device, dtype=sorted_keys.dtype),
                       out_int32=True, out=rowptr)
    rows.copy_(order if nhb == 1 else (order // kp) * (nhb * kp) + order % kp)


def slot_order_async(idx: Tensor, n_rows: int, kp: int, nhb: int):
    """:func:`slot_order` on a side stream (it needs only the indices, so it overlaps the main program);
    returns a function that makes the current stream wait and gives (Rows, RowPtr). Both are allocated on
    the current stream before the fork and only filled on the side one (whose own temporaries never leave
    it), so no tensor changes streams and CUDA-graph capture sees a plain fork and join. The caller must
    call the function (a try / finally) so the side stream always joins."""
    rows = torch.empty(idx.numel(), device=idx.device, dtype=torch.int32)
    rowptr = torch.empty(n_rows + 1, device=idx.device, dtype=torch.int32)
    if idx.device.type != "cuda":
        slot_order(idx, n_rows, kp, nhb, rows, rowptr)
        return lambda: (rows, rowptr)
    main = torch.cuda.current_stream(idx.device)
    side = _SIDE_STREAMS.get(idx.device)
    if side is None:
        side = _SIDE_STREAMS[idx.device] = torch.cuda.Stream(idx.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        slot_order(idx, n_rows, kp, nhb, rows, rowptr)

    def ready():
        main.wait_stream(side)
        return rows, rowptr

    return ready


def reduce_body(dqk, nhb, contrib_dtype="float32", block=8, perm=False, warps=4):
    """dKV[n] += sum of the contribution rows of kv row n, in a fixed order: Rows[RowPtr[n]:RowPtr[n + 1]]
    are the rows (of group 0 of the ``nhb`` contribution groups of a query row, head blocks or their pairs; group g
    is g * kp rows further) of the slots naming n, sorted.
    ``contrib_dtype``: the contribution buffer's ("float32"; "bfloat16" for "contrib_bf16"; "int16" for
    "contrib_i16", each value times the power of two whose exponent field is its block's byte in Exps:
    exact); the sums are fp32. ``block``: values per exponent byte, 8 (columns x..x+3 and x+32..x+35 of each
    64-column chunk, x a multiple of 4 below 32) or 4 (columns x..x+3: the rows of the ws program's pairs).
    ``perm`` (block 8): the ws program's ``dkv_perm`` rows, each lane's values as they come from its accumulator:
    within each group of 32 columns, real column 16 j + 8 h + 2 q + e (j, h, e < 2, q < 4) is stored at
    8 q + 4 j + 2 h + e, so a block is 8 consecutive stored columns (32 p + 8 q .. + 7 of each 64-column chunk,
    byte 8 chunk + 2 q + p), and each sum goes to its real column.

    One CTA per kv row. Warp w sums the row's sorted slots w, w + warps, ... in turn (its lanes read
    each contribution row as coalesced runs of 8 bytes a lane: 64 fp32 or 128 bf16 columns, so
    dqk / 64 or dqk / 128 independent loads in flight per slot),
    then the warps' partial sums are added in warp order through shared memory: the order never
    depends on timing. (One thread per column walking every slot in turn left each load waiting on
    the previous slot's index: latency-bound at 1.3-2.7 TB/s.)"""
    import tilelang.language as T

    f32 = T.float32
    i32 = T.int32
    M = T.dynamic("M")  # Tq * nhb * Kp contribution rows
    L = T.dynamic("L")  # Tq * Kp slots
    N = T.dynamic("N")
    N1 = T.dynamic("N1")  # N + 1
    scaled = contrib_dtype == "int16"
    vec = 2 if contrib_dtype == "float32" else 4  # columns per lane and run: 8 bytes
    width = 32 * vec
    runs = (dqk + width - 1) // width  # runs of `width` columns (the last one partial where dqk is not a multiple)
    whole = dqk % width == 0
    threads = 32 * warps

    @T.prim_func
    def dsa_bwd_reduce(
        Contrib: T.Tensor([M, dqk], getattr(T, contrib_dtype)),
        Exps: T.Tensor([M, dqk // block] if scaled else [1], T.uint8),
        Rows: T.Tensor([L], i32),
        RowPtr: T.Tensor([N1], i32),
        dKV: T.Tensor([N, dqk], f32),
        kp: i32,
    ):
        with T.Kernel(N, threads=threads) as n:
            tx = T.get_thread_binding()
            w = tx // 32
            lane = tx % 32
            acc = T.alloc_local([runs * vec], f32)
            part = T.alloc_shared([warps, dqk], f32)
            for r in T.serial(runs * vec):
                acc[r] = 0.0
            start = RowPtr[n]
            count = RowPtr[n + 1] - start
            for it in T.serial(T.ceildiv(count, warps)):
                if it * warps + w < count:
                    base = T.alloc_var(i32, init=Rows[start + it * warps + w])
                    for hb in T.unroll(nhb):
                        for r in T.unroll(runs):
                            if scaled:  # the lane's 4 columns lie in one block: 64-column chunk, 4-column group
                                col = r * width + lane * vec
                                blk = (T.min(col // 64 * 8 + col % 32 // 8 * 2 + col % 64 // 32, dqk // 8 - 1) if perm
                                       else T.min(col // 64 * 8 + col % 32 // 4, dqk // 8 - 1) if block == 8
                                       else T.min(col // 4, dqk // 4 - 1))
                                # exponent byte 255 (a block that held a value that is not finite): NaN, so
                                # that its sum is NaN whatever the block's stored values
                                ex = T.alloc_var(T.uint32, init=T.cast(Exps[base + hb * kp, blk], T.uint32))
                                sc = T.alloc_var(f32, init=T.reinterpret(T.bitwise_or(
                                    T.shift_left(ex, T.uint32(23)),
                                    T.if_then_else(ex == T.uint32(255), T.uint32(0x400000), T.uint32(0))), f32))
                                for c in T.vectorized(vec):
                                    if whole or r * width + lane * vec + c < dqk:
                                        acc[r * vec + c] += T.cast(Contrib[base + hb * kp, r * width + lane * vec + c],
                                                                   f32) * sc
                            else:
                                for c in T.vectorized(vec):
                                    if whole or r * width + lane * vec + c < dqk:
                                        acc[r * vec + c] += T.cast(Contrib[base + hb * kp, r * width + lane * vec + c],
                                                                   f32)
            for r in T.unroll(runs):
                for c in T.vectorized(vec):
                    if whole or r * width + lane * vec + c < dqk:
                        part[w, r * width + lane * vec + c] = acc[r * vec + c]
            T.sync_threads()
            for k in T.serial(T.ceildiv(dqk, threads)):
                col = k * threads + tx
                if col < dqk:
                    total = T.alloc_var(f32, init=0.0)
                    for ww in T.unroll(warps):
                        total += part[ww, col]
                    if perm:  # stored column 8 q + 4 j + 2 h + e of a group of 32 is real column 16 j + 8 h + 2 q + e
                        dKV[n, col // 32 * 32 + col % 8 // 4 * 16 + col % 4 // 2 * 8 + col % 32 // 8 * 2 + col % 2] += total
                    else:
                        dKV[n, col] += total

    return dsa_bwd_reduce


_COMPILED: dict = {}
_LOCK = threading.Lock()


def build_reduce(dqk: int, nhb: int, contrib_dtype: str = "float32", block: int = 8, perm: bool = False, *,
                 target="auto"):
    """The compiled reduce program (:func:`reduce_body`) for rows of ``dqk`` columns, ``nhb`` contribution
    rows per slot, ``contrib_dtype`` ("float32", "bfloat16" or "int16"), ``block`` values per exponent byte
    (int16) and ``perm`` (rows with permuted columns); cached per process."""
    import tilelang

    if block not in (4, 8) or (perm and (block != 8 or dqk % 32)):
        raise ValueError(f"block must be 4 or 8 values per exponent byte (8 with permuted columns, dqk a multiple of "
                         f"32), got block {block}, perm {perm}, dqk {dqk}")
    key = (target_key(target), int(dqk), int(nhb), str(contrib_dtype), int(block), bool(perm))

    def build():
        # Without TileLang's safe-memory legalisation: it wraps each load whose row comes from Rows in a bounds test
        # and a zero fill, though every index here is in bounds by construction (Rows names valid contribution
        # rows only; the column tests and the exponent-byte clamp are the program's own). The int16 loop falls
        # from 167 to 106 sm_90a instructions a row; H200, deterministic mode, same bits: MLA H64 1.051x, MLA
        # H128 1.092x, V4 H128 1.005x, V4 H64 1.012x (``ab_bwd_patch.py``, 2026-11-29).
        prog = tilelang.jit(target=target, pass_configs={"tl.disable_safe_memory_legalize": True})(
            reduce_body)(*key[1:])
        logger.info("dsa_plugins: compiled the contribution reduce %s for %s", key[1:], target)
        return prog

    return compiled_once(_COMPILED, _LOCK, key, "deterministic contribution reduce", build)
