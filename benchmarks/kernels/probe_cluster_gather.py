"""Probe: can two CTAs share one gather of kv rows (each gathers half, forwards it to its peer)?

    python benchmarks/kernels/probe_cluster_gather.py [--dim 576] [--rows 4096] [--topk 2048] [--keys 8192]

The forward's main loop is bound by L2-to-SM bandwidth (``benchmarks/results/fwd_fixed_cost_h100.md``): each
64-slot block moves 64 gathered rows into the CTA. At H 128 the two head blocks of a query gather the same
rows. This probe moves rows only, with no math, in the forward's pattern: 128 producer threads gather one
block into a double-buffered stage with predicated 16-byte cp.async, and 128 consumer threads wait for the
stage, read it and release it. The modes, timed on the same indices:

- ``alone``: every CTA gathers all 64 rows of each block (today's forward);
- ``alone_cluster``: the same, launched as clusters of two (what cluster scheduling costs by itself);
- ``tma_warp`` / ``tma_lanes``: as ``alone``, the rows gathered by TMA (one 128-byte piece of a row per copy, into
  the 128-byte swizzled 64-column chunks the MMAs read), from one lane per producer warp or from all 128 lanes;
- ``share``: the two CTAs of a cluster gather 32 rows each, wait for them, and forward them to the peer
  with bulk SM-to-SM copies (``T.copy_cluster``: 4 KB pieces, completing on the peer's barrier). A stage
  is ready when the CTA's own rows and the peer's bytes have landed, and free when both CTAs' consumers
  have released it.

Printed: time per launch and GB/s of rows delivered into shared memory (both CTAs count the full 64 rows).

The same probe gives a generation step's floor (``attention_decode.md``): ``--segments`` gives each index row
a cache of its own (HBM-sized, as one cache per sequence), ``--variants 2x64,3x64@1600,...`` tries pipelines of
more or fewer stages whose consumers hold each one for a while (a stand-in for the MMAs), ``--flush`` evicts
L2 before each launch. E.g. GLM-5's step at B 64 (two CTAs per row of 2048 slots)::

    python benchmarks/kernels/probe_cluster_gather.py --modes alone --rows 64 --topk 1024 --distinct \
        --segments 64 --keys 32768 --variants 2x64,2x64@1600,3x64
If ``share`` delivers well above ``alone``, the forward at H 128 can be rebuilt around it; if not, the
gather-then-forward latency or the SM-to-SM path is the limit. Compiled on the CPU by the test suite
(``tests/test_forward_tools.py``); written before it could run on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys

MODES = ("alone", "alone_cluster", "share")
# the same pipeline with the rows gathered by TMA instead of cp.async (64 columns, one 128-byte swizzled row
# piece per TMA; out-of-range rows, -1 among them, come back as zeros with their bytes counted): "tma_warp" as
# TileLang's tma_copy issues it (one lane per producer warp, an expect_tx per piece), "tma_lanes" every producer
# lane issuing its own pieces and one arrive.expect_tx of the whole block
TMA_MODES = ("tma_warp", "tma_lanes")
_BLOCK = 64  # rows per stage (the forward's block_k)
_PIECE = 2048  # bf16 elements per forwarded piece (4 KB, a 32-row half of one 64-column chunk in the forward)

# the consumers' stand-in for their MMAs (hold_ns): spin on the global timer
_HOLD_PRELUDE = r"""
__device__ __forceinline__ int dsa_hold(int ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
  return 0;
}
"""


def _consumer_macro():
    """The consumers' loop of every mode (a TileLang macro): wait for each stage, add ``read(st)`` (an expression of
    the stage) to ``acc[0]``, hold it ``hold_ns``, free it (and the peer's copy, rank ``peer``, in "share")."""
    import tilelang.language as T

    @T.macro
    def consume(stage_ids, n_trips, ready, free, acc, tx, read, hold_ns, peer):
        acc[0] = 0.0
        for t in T.serial(n_trips):
            for st in stage_ids:
                T.mbarrier_wait_parity(ready[st], t & 1)
                acc[0] += read(st)
                if hold_ns:
                    if tx == 128:
                        T.evaluate(T.call_extern("int32", "dsa_hold", hold_ns))
                T.sync_threads(14, 128)
                if tx == 128:
                    T.barrier_arrive(free[st])
                    if peer is not None:
                        T.ptx_arrive_cluster_barrier(free[st], peer)

    return consume


def probe_program(dim: int, mode: str, distinct: bool = False, stages: int = 2, block: int = _BLOCK,
                  hold_ns: int = 0):
    """The TileLang program of one mode: (KV [N, dim] bf16, Idx [R, KP] int32, Out [R, 2] fp32), grid 2 R.
    ``distinct`` (not with "share"): the two CTAs of a pair gather different index rows (Idx [2 R, KP],
    CTA b reads row b), to tell co-scheduling by itself from two SMs fetching the same rows at once.
    ``stages`` buffers of ``block`` rows each ("alone" modes; the forward: 2 x 64); ``hold_ns``: the consumers
    keep each stage that long before freeing it (a stand-in for the forward's MMAs on it)."""
    assert not (distinct and mode == "share"), "share needs both CTAs on the same rows"
    assert mode != "share" or (stages, block) == (2, _BLOCK), "share is written for 2 stages of 64 rows"
    assert block % 16 == 0 and stages >= 2
    import tilelang.cuda.language as TC
    import tilelang.language as T

    consume = _consumer_macro()
    share = mode == "share"
    cluster = mode != "alone"
    own = _BLOCK // 2 if share else block  # rows each CTA gathers per block
    stage_ids = tuple(range(stages))
    passes = tuple(range(own // 16))  # 16 rows per pass: 8 threads x 16 bytes per row piece
    chunks = tuple(range(dim // 64))
    pieces = tuple(range((_BLOCK // 2) * dim // _PIECE))
    R, N, KP, RI = T.dynamic("R"), T.dynamic("N"), T.dynamic("KP"), T.dynamic("RI")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32

    @T.prim_func
    def probe(KV: T.Tensor([N, dim], bf16), Idx: T.Tensor([RI, KP], i32),
              Out: T.Tensor([R, 2], f32)):
        with T.Kernel(2 * R, threads=256, cluster_dims=2 if cluster else 1,
                      prelude=_HOLD_PRELUDE if hold_ns else None) as bx:
            bufs = [T.alloc_shared([block * dim], bf16) for _ in stage_ids]
            # ready: own producer arrivals (cp.async-tracked and explicit: 2 x 128), or in "share" 128 explicit
            # arrivals after the rows landed plus one remote arrive.expect_tx per forwarded piece
            # (barriers a peer can reach only where the launch has clusters, as in the forward otherwise)
            alloc = T.alloc_cluster_barrier if cluster else T.alloc_barrier
            ready = alloc([128 + len(pieces) if share else 256] * stages)
            # free: the own consumers, and in "share" the peer's consumers too (they receive our rows)
            free = alloc([2 if share else 1] * stages)
            idx_reg = T.alloc_local([len(passes)], i32)
            acc = T.alloc_local([1], f32)
            tx = T.get_thread_binding()
            rank = bx % 2
            row = bx // 2
            idx_row = T.min(bx, RI - 1) if distinct else T.min(row, RI - 1)  # (RI named in the body: annotations resolve through it)
            first = rank * (_BLOCK // 2) if share else 0  # this CTA's rows of each block
            n_trips = KP // (stages * block)
            if tx < 128:
                lane = tx % 8
                for t in T.serial(n_trips):
                    for st in stage_ids:
                        T.mbarrier_wait_parity(free[st], (t & 1) ^ 1)
                        for r in passes:
                            idx_reg[r] = Idx[idx_row, (stages * t + st) * block + first + r * 16 + tx // 8]
                        for r in passes:
                            ok = (idx_reg[r] >= 0) and (idx_reg[r] < N)
                            src = T.if_then_else(ok, idx_reg[r], 0)
                            for c in chunks:
                                col = c * 64 + lane * 8
                                T.ptx_cp_async(T.access_ptr(bufs[st][(first + r * 16 + tx // 8) * dim + col], "w", 8),
                                               T.access_ptr(KV[src, col], "r", 8), 8, ok)
                        T.ptx_commit_group()
                        if share:
                            # forward our half once it has landed: each thread's copies done, visible to the
                            # async proxy, all 128 threads past that point, then one thread sends the pieces
                            T.ptx_wait_group(0)
                            T.fence_proxy_async()
                            T.barrier_arrive(ready[st])
                            T.sync_threads(15, 128)
                            if tx == 0:
                                for p in pieces:
                                    lo = first * dim + p * _PIECE
                                    T.copy_cluster(bufs[st][lo : lo + _PIECE], bufs[st][lo : lo + _PIECE],
                                                   dst_block=1 - rank, remote_barrier=ready[st])
                        else:
                            T.cp_async_barrier_noinc(ready[st])
                            T.barrier_arrive(ready[st])
            else:
                # read one element of every row (the forward's MMAs read them all)
                consume(stage_ids, n_trips, ready, free, acc, tx,
                        lambda st: T.cast(bufs[st][((tx - 128) % block) * dim + (tx - 128) // block], f32),
                        hold_ns, 1 - rank if share else None)
                if tx == 128:
                    Out[row, rank] = acc[0]
            if cluster:
                TC.cluster_sync()  # no CTA leaves while its peer may still write to it or arrive on it

    return probe


# tma_lanes: TileLang names the kv tensor map KV_desc where one tma_copy of KV exists in the program; every lane
# issues its own pieces through it. Included as a header by the compile flags (a prelude beside a tensor map fails
# TileLang's codegen, and nvcc splits -D values at commas)
_TMA_LANES_HEADER = """
#define DSA_TMA_PIECE(st, base, row_off, col, row) \\
  tl::tma_load(KV_desc, ready[st], (void*)((char*)(base) + (row_off) * 128), (col), (row))
#define DSA_ARRIVE_TX(st, bytes) ready[st].arrive_and_expect_tx(bytes)
"""


def _tma_lanes_flags() -> list:
    import os
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "dsa_probe_tma_lanes.h")
    with open(path, "w") as f:
        f.write(_TMA_LANES_HEADER)
    return ["-include", path]


def tma_probe_program(dim: int, mode: str, distinct: bool = False, stages: int = 2, block: int = _BLOCK,
                      hold_ns: int = 0):
    """``alone``'s pipeline with TMA gathers (``TMA_MODES``); same arguments and grid as ``probe_program``, but
    Out [2 R, 128]: consumer thread u of CTA b sums, over the blocks, elements 0 and dim - 63 of the block's row
    u % block (``expected_tma_sums``). A stage is [dim / 64 * block, 64] bf16, chunk c of row r at row
    c * block + r (the forward's layout)."""
    assert mode in TMA_MODES and block % 16 == 0 and stages >= 2 and dim % 64 == 0
    assert not hold_ns, "the TMA modes take no hold (its prelude and a tensor map do not compile together)"
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    consume = _consumer_macro()
    lanes = mode == "tma_lanes"
    stage_ids = tuple(range(stages))
    n_chunks = dim // 64
    chunks = tuple(range(n_chunks))
    pieces = block * n_chunks
    per_lane = (pieces + 127) // 128
    R, N, KP, RI = T.dynamic("R"), T.dynamic("N"), T.dynamic("KP"), T.dynamic("RI")
    bf16, f32, i32 = T.bfloat16, T.float32, T.int32

    @T.prim_func
    def probe(KV: T.Tensor([N, dim], bf16), Idx: T.Tensor([RI, KP], i32),
              Out: T.Tensor([2 * R, 128], f32)):
        with T.Kernel(2 * R, threads=256) as bx:
            bufs = [T.alloc_shared([n_chunks * block, 64], bf16) for _ in stage_ids]
            T.annotate_layout({b: make_swizzled_layout(b) for b in bufs})
            # tma_warp: the 4 producer warps' leaders arrive once each (their expect_tx per piece);
            # tma_lanes: one arrive.expect_tx of the block's bytes
            ready = T.alloc_barrier([1 if lanes else 4] * stages)
            free = T.alloc_barrier([1] * stages)
            acc = T.alloc_local([1], f32)
            tx = T.get_thread_binding()
            idx_row = T.min(bx, RI - 1) if distinct else T.min(bx // 2, RI - 1)
            n_trips = T.cast(KP // (stages * block), i32)  # (every name of the annotations appears in the body)
            if tx < 128:
                w = tx // 32
                # never (no index is that low): only so that TileLang emits KV's tensor map, KV_desc (a condition
                # it cannot decide, or it drops the copy and the map with it)
                if Idx[idx_row, 0] < -(1 << 30):
                    T.tma_copy(KV[N - 1 : N, dim - 64 : dim], bufs[0][0:1, 0:64], barrier=ready[0])
                for t in T.serial(n_trips):
                    for st in stage_ids:
                        T.mbarrier_wait_parity(free[st], (t & 1) ^ 1)
                        slot0 = (stages * t + st) * block
                        if lanes:
                            for j in T.serial(per_lane):
                                p = tx + 128 * j
                                if p < pieces:
                                    r = p // n_chunks
                                    c = p % n_chunks
                                    T.evaluate(T.call_extern("handle", "DSA_TMA_PIECE", st,
                                                             T.address_of(bufs[st][0, 0]), c * block + r,
                                                             c * 64, Idx[idx_row, slot0 + r]))
                            if tx == 0:
                                T.evaluate(T.call_extern("handle", "DSA_ARRIVE_TX", st, pieces * 128))
                        else:
                            for r in T.serial(block // 4):
                                row = w * (block // 4) + r
                                src = Idx[idx_row, slot0 + row]
                                for c in chunks:
                                    T.tma_copy(KV[src : src + 1, c * 64 : c * 64 + 64],
                                               bufs[st][c * block + row : c * block + row + 1, 0:64],
                                               barrier=ready[st], leader_scope_threads=32)
                            if T.shuffle_elect(32):
                                T.barrier_arrive(ready[st])
            else:
                # one element of every row piece of the first and last chunk
                consume(stage_ids, n_trips, ready, free, acc, tx,
                        lambda st: T.cast(bufs[st][(tx - 128) % block, 0], f32)
                        + T.cast(bufs[st][(n_chunks - 1) * block + (tx - 128) % block, 1], f32), 0, None)
                Out[bx, tx - 128] = acc[0]  # every consumer thread's sum (rows of every swizzle phase)

    return probe


def expected_tma_sums(kv, idx, rows: int, block: int, distinct: bool):
    """What ``tma_probe_program`` writes to Out [2 rows, 128], from torch (fp32 sums in the kernel's order)."""
    import torch

    n, dim = kv.shape
    pair = torch.arange(2 * rows, device=idx.device)
    rows_idx = idx[pair if distinct else pair // 2].long()  # [2 rows, KP]
    ok = (rows_idx >= 0) & (rows_idx < n)
    safe = rows_idx.clamp(0, n - 1)
    vals = (kv[safe, 0].float() + kv[safe, dim - 63].float()) * ok  # out-of-range rows land as zeros
    u = torch.arange(128, device=idx.device) % block
    acc = torch.zeros(2 * rows, 128, device=idx.device)
    for b in range(idx.shape[1] // block):
        acc += vals[:, b * block + u]
    return acc


def build(dim: int, mode: str, target="auto", distinct: bool = False, stages: int = 2, block: int = _BLOCK,
          hold_ns: int = 0):
    import tilelang

    program = tma_probe_program if mode in TMA_MODES else probe_program
    flags = ["-O3", "-DNDEBUG"] + (_tma_lanes_flags() if mode == "tma_lanes" else [])
    return tilelang.jit(target=target, compile_flags=flags)(program)(
        dim, mode, distinct, stages, block, hold_ns)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=576, help="row width in bf16 (576 MLA, 512 V4)")
    ap.add_argument("--rows", type=int, default=4096, help="query rows (clusters of two CTAs each)")
    ap.add_argument("--topk", type=int, default=2048, help="slots per row (a multiple of 128)")
    ap.add_argument("--keys", type=int, default=8192, help="kv rows to pick from")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {MODES + TMA_MODES}")
    ap.add_argument("--distinct", action="store_true", help="the CTAs of a pair gather different rows (alone modes)")
    ap.add_argument("--stages", type=int, default=2, help="stage buffers (alone modes)")
    ap.add_argument("--block", type=int, default=_BLOCK, help="rows per stage (a multiple of 16; alone modes)")
    ap.add_argument("--hold-ns", type=int, default=0, help="the consumers hold each stage this long (MMA stand-in)")
    ap.add_argument("--segments", type=int, default=1,
                    help="a cache of --keys rows per segment; index row i picks from segment i %% segments "
                         "(a generation step: one cache per sequence, HBM-sized)")
    ap.add_argument("--flush", action="store_true", help="evict L2 (a 256 MB write) before every timed launch")
    ap.add_argument("--variants", default=None,
                    help="alone modes only: several pipelines in one process, 'STAGESxBLOCK[@HOLD_NS],...' "
                         "(overrides --stages, --block, --hold-ns)")
    args = ap.parse_args(argv)
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(args.keys * args.segments, args.dim, device="cuda", generator=g).bfloat16()
    n_idx = args.rows * (2 if args.distinct else 1)
    idx = torch.rand(n_idx, args.keys, device="cuda", generator=g).topk(args.topk, dim=-1).indices.int()
    idx += (torch.arange(n_idx, device="cuda", dtype=torch.int32) % args.segments).mul(args.keys)[:, None]
    out2 = torch.empty(args.rows, 2, device="cuda")
    out_tma = torch.empty(2 * args.rows, 128, device="cuda")
    delivered = 2 * args.rows * args.topk * args.dim * 2  # bytes landing in shared memory, both CTAs
    # distinct rows read (both CTAs of a pair read one set unless --distinct)
    distinct_bytes = n_idx * args.topk * args.dim * 2
    scrub = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if args.flush else None
    pipelines = [(args.stages, args.block, args.hold_ns)]
    if args.variants:
        pipelines = []
        for v in args.variants.split(","):
            shape, _, hold = v.partition("@")
            st, _, blk = shape.partition("x")
            pipelines.append((int(st), int(blk), int(hold or 0)))
    sums = {}
    for mode, (stages, block, hold_ns) in ((m, p) for m in args.modes.split(",") for p in pipelines):
        if args.distinct and mode == "share":
            continue
        if mode == "share" and (stages, block) != (2, _BLOCK):
            continue
        kernel = build(args.dim, mode, distinct=args.distinct, stages=stages, block=block, hold_ns=hold_ns)
        out = out_tma if mode in TMA_MODES else out2
        for _ in range(3):
            kernel(kv, idx, out)
        torch.cuda.synchronize()
        sums[mode, stages, block, hold_ns] = out.clone()
        times = []
        for _ in range(20):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if scrub is not None:
                scrub.fill_(1)
            start.record()
            kernel(kv, idx, out)
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        ms = statistics.median(times)
        alone = sums.get(("alone", stages, block, hold_ns))  # the same pipeline without clusters
        same = "" if mode == "alone" or alone is None else f", same sums as alone: {torch.equal(out, alone)}"
        if mode in TMA_MODES:
            want = expected_tma_sums(kv, idx, args.rows, block, args.distinct)
            same = f", sums as torch's: {torch.allclose(out, want, rtol=1e-4, atol=1e-3)}"
        print(f"{mode:14s} D{args.dim}{' distinct' if args.distinct else ''} rows {args.rows} k {args.topk} "
              f"stages {stages}x{block} hold {hold_ns} ns segments {args.segments}x{args.keys}"
              f"{' flushed' if args.flush else ''}: "
              f"{ms * 1e3:.1f} us, {delivered / ms / 1e6:.0f} GB/s into shared memory, "
              f"{distinct_bytes / ms / 1e6:.0f} GB/s of distinct rows{same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
