"""Lightning indexer scores + exact top-k (TileLang, Hopper).

Design: chunked, not fully fused. Query rows are processed in chunks; for one chunk a
TileLang GEMM kernel writes the fp32 scores of the chunk's key range into a
[chunk_rows, chunk_width] buffer, then the radix top-k of ``topk.py`` selects inside each
row's window. Peak extra memory is bounded by ``max_chunk_bytes`` (1 GiB by default),
never O(Tq * Tk) for the whole batch.

Score kernel (one CTA per ``block_q`` query rows): the ``block_q * Hi`` query vectors stay
in shared memory; the kernel walks only the key blocks that intersect the windows of its
rows and, per key block, computes S = K_blk [block_k, Di] x Q^T [Di, block_q*Hi] with
wgmma (keys are the M dimension, so the reduction over heads stays inside a thread quad),
then relu(S) * w[q, h] summed over heads, and stores the [block_q, block_k] tile. Entries
of a computed tile outside a row's window hold scores of keys the row may not see; the
top-k never reads them. Query blocks are launched last-first, so that under a causal mask
the longest CTAs start early. With few query blocks (generation: one row per sequence over a
long cache) the key range of each block is split over several CTAs (a second grid dimension;
each key tile still has one writer), so the GPU fills: 3-10x faster decode steps on an H200.
When the whole [Tq, Tk] buffer fits the budget there is one chunk and no host
synchronisation; otherwise one host sync plans the chunks.

Measured on an H200 (bf16, Hi 64, Di 128, k 2048, one causal sequence, top-k included,
2*Hi*Di FLOPs per causal pair): T 8K 1.24 ms = 442 TFLOP/s (scores alone 565, top-k 21%);
T 32K 480 TFLOP/s (top-k 19%); T 64K 489 TFLOP/s (top-k 16%).

fp8 (``fp8=True``, DeepSeek-V3.2 inference): e4m3 q and k, the score of key s times a per-key
scale staged by the producer with the key block. Same H200, same run: T 8K 1.02 ms (1.19x bf16),
32K 1.27x, 64K 1.31x; Hi 32 T 8K 1.14x. The fp8 MMAs have twice the throughput but the epilogue
(relu, weights, head sum, score store) and the top-k do not change: the score kernel gains 1.36x
(742 vs 546 TFLOP/s at 8K). The fp8 key cache is half the size.

``ws`` must stay True: the non-warp-specialised pipeline does not lower in TileLang 0.1.15
with the run-time loop start used here.

Tried (H100, 2026-11-26, do_bench, T 8K / 32K causal): the shipped tiling 1.013 / 15.56 ms (543 / 565
TFLOP/s); ``block_q`` 2 1.066 / 16.63; ``block_q`` 2 with two accumulators and asynchronous wgmma, the
epilogue of one key block under the MMA of the next (``T.wgmma_gemm``, the stage freed after the wait),
1.087-1.105 / 16.55-16.63: the epilogue is not what limits it; one TMA store per two key blocks (fewer
store waits) 1.083 / 16.61. (Carrying the overlap across loop iterations
makes ptxas inject a ``warpgroup.wait`` before the epilogue, C7517.)

Hand-specialised score program (``pingpong``; the prefill's for 32 and 64 index heads of 128): a producer
warpgroup loads Q once and key blocks into four TMA stages; two consumers take alternate 64-key blocks whole
(an m64n256 MMA over all block_q * heads columns) and hand each other the turn to issue their MMAs, so one
runs its epilogue while the other's MMAs hold the tensor cores. Unlike the overlap inside one consumer above,
it pays: H100, T 8K, scores 1.05-1.10x bf16 and 1.09-1.17x fp8, the same scores bit for bit where block_q
matches the tiled program's (indexer_fp8.md). The tiled programs (``TILED_CONFIGS``) stay for the dense
warm-up loss, whose programs follow their key blocks, and for the generation steps.

The relu is one ``max.NaN`` (``relu_max``, default): a NaN score stays NaN, as with the compare and select it
replaced, at one instruction per score instead of two (scores 1.04-1.08x faster on an H100).

TileLang is imported lazily so that this module imports without TileLang or a GPU.

Size: one file for the family: the score and plan programs, their configurations (prefill and
generation steps), the chunk planner and the wrapper share the tiling and the buffer layout.
"""

import functools
import logging
import threading

import numpy as np

from . import topk as _topk
from . import aligned_operand, announce_compile

logger = logging.getLogger("dsa_plugins")

#: Compile-time configurations of TileLang's own warp specialisation (the score MMAs of a key block, then its
#: epilogue). Row counts, key counts and the chunk width are run-time sizes. They tile the dense warm-up loss
#: (its score-gradient and dense programs follow the score buffer's key blocks) and the generation steps, and
#: score the prefill where no hand-specialised program is faster.
TILED_CONFIGS: list = [
    {"heads": 64, "dim": 128, "block_q": 4, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True},
    {"heads": 32, "dim": 128, "block_q": 4, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True},
    {"heads": 16, "dim": 64, "block_q": 4, "block_k": 64, "threads": 128, "num_stages": 2, "ws": True},
    # fp8 e4m3 q/k with per-token key scales (DeepSeek-V3.2 inference): the same tiling, chosen by
    # a sweep on an H200 (split_n, block_k 64 or 256, block_q 2 or 8 for Hi 64: no faster)
    {"heads": 64, "dim": 128, "block_q": 4, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True, "fp8": True},
    {"heads": 32, "dim": 128, "block_q": 8, "block_k": 128, "threads": 256, "num_stages": 2, "ws": True, "fp8": True},
]

#: The prefill's score program (the indexer top-k over many query rows): for 32 and 64 index heads of 128 the
#: hand-specialised one (``pingpong``: one consumer's epilogue runs beside the other's MMAs), 64-key blocks of
#: 256 columns (block_q * heads). H100, T 8K / 32K causal, the same sets, against the tiled program: Hi 64 scores
#: 1.05-1.07x bf16 and 1.15-1.17x fp8; Hi 32 1.08-1.10x / 1.05-1.08x bf16 and 1.09-1.10x fp8 at T 8K; indexer +
#: top-k 1.03-1.10x (indexer_fp8.md). At Hi 32 with 128 columns (block_q 4) it was 0.97-0.98x.
PREFILL_CONFIGS: list = [
    {**cfg, "block_q": 256 // cfg["heads"], "block_k": 64, "pingpong": True}
    if cfg["dim"] == 128 and cfg["heads"] in (32, 64) else cfg
    for cfg in TILED_CONFIGS
]

#: Generation steps (up to DECODE_MAX_ROWS query rows): one row per CTA (``block_q`` 1), so rows
#: of different sequences never share a CTA's MMAs or score columns; the key reads dominate, so
#: one more stage of them is in flight.
DECODE_MAX_ROWS = 256
DECODE_CONFIGS: list = [{**cfg, "block_q": 1, "num_stages": 3} for cfg in TILED_CONFIGS]

#: Every configuration shipped (the CPU test compiles each one for sm_90a; warmup fills the cache).
SHIPPED_CONFIGS: list = PREFILL_CONFIGS + [c for c in TILED_CONFIGS if c not in PREFILL_CONFIGS] + DECODE_CONFIGS

#: Default chunk buffer budget (bytes of fp32 scores held at once).
DEFAULT_MAX_CHUNK_BYTES = 1 << 30

_CFG_KEYS = ("heads", "dim", "block_q", "block_k", "threads", "num_stages", "ws", "split_n", "fp8", "relu_max",
             "pingpong")

# relu as one max.NaN (sm_80+: NaN in, NaN out; a negative score or -0.0 gives +0.0), where a compare and a select
# per score were needed to keep a NaN score NaN (fmaxf would turn it into 0)
_RELU_PRELUDE = r"""
__device__ __forceinline__ float dsa_relu_keep_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}
"""


def default_config(heads: int, dim: int, fp8: bool = False, rows: int | None = None, tiled: bool = False) -> dict:
    """The shipped configuration for (heads, dim, fp8) and ``rows`` query rows (at most
    ``DECODE_MAX_ROWS``: a generation step's), else a generic one. ``tiled``: TileLang's own specialisation
    (TILED_CONFIGS) in place of a hand-specialised prefill program."""
    decode = rows is not None and rows <= DECODE_MAX_ROWS
    for cfg in DECODE_CONFIGS if decode else TILED_CONFIGS if tiled else PREFILL_CONFIGS:
        if cfg["heads"] == heads and cfg["dim"] == dim and cfg.get("fp8", False) == fp8:
            return dict(cfg)
    block_q = 1 if decode else (max(1, min(4, 256 // heads)) if heads <= 256 else 1)
    return {"heads": heads, "dim": dim, "block_q": block_q, "block_k": 64, "threads": 128, "num_stages": 2, "ws": True,
            "fp8": fp8}


def _pass_configs(ws: bool):
    import tilelang

    cfg = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}
    if not ws:
        cfg[tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED] = True
    return cfg


@functools.lru_cache(maxsize=None)
def _factory():
    """Build the @tilelang.jit factory (TileLang imported here, not at module import)."""
    import tilelang
    import tilelang.language as T

    @T.macro
    def cta_key_blocks(BlkLo, BlkHi, nqb, splits, width, block_k, bx, by):
        # The CTA's query block and key blocks [lo, hi). Grid (query blocks, splits): split s of a query block takes
        # the s-th part of its key blocks (each key block's tile is written by one CTA, so the splits need no
        # merge). Last query blocks first: under a causal mask they have the most key blocks, so the long CTAs
        # start early and the tail of the grid is short.
        qb = nqb - 1 - bx
        per = T.ceildiv(BlkHi[qb] - BlkLo[qb], splits)
        lo = BlkLo[qb] + by * per
        # (never past the buffer: a window outside the bound the caller gave is cut, not written out of bounds)
        hi = T.min(T.min(BlkHi[qb], lo + per), BlkLo[qb] + width // block_k)
        return qb, lo, hi

    @tilelang.jit
    def indexer_scores(
        heads: int, dim: int, block_q: int, block_k: int, threads: int, num_stages: int, split_n: bool = False,
        fp8: bool = False, relu_max: bool = False,
    ):
        # split_n: the warpgroups split the (query, head) columns instead of the key rows;
        # each warpgroup must then hold whole queries (all heads of a query).
        # fp8: e4m3 q and k (both operands K-major, as fp8 wgmma needs), the score of key s
        # multiplied by KScale[s] (per-token key scale; q scales are folded into W by the caller).
        # Without fp8, KScale is not read (a one-element placeholder).
        policy = T.GemmWarpPolicy.FullCol if split_n else T.GemmWarpPolicy.FullRow
        nq = T.dynamic("nq")  # query rows of the chunk
        nk = T.dynamic("nk")  # key rows
        nks = T.dynamic("nks")  # key scales: nk with fp8, else 1
        width = T.dynamic("width")  # columns of the score buffer (multiple of block_k)
        nqb = T.dynamic("nqb")  # query blocks = ceil(nq / block_q)
        dtype = T.float8_e4m3fn if fp8 else T.bfloat16
        acc = T.float32

        @T.prim_func
        def main(
            Q: T.Tensor([nq * heads, dim], dtype),
            K: T.Tensor([nk, dim], dtype),
            W: T.Tensor([nq, heads], acc),
            KScale: T.Tensor([nks], acc),
            BlkLo: T.Tensor([nqb], T.int32),
            BlkHi: T.Tensor([nqb], T.int32),
            splits: T.int32,
            Scores: T.Tensor([nq, width], acc),
        ):
            # Score columns are relative to the block's first key block (BlkLo): a row's buffer holds
            # its block's key range only, whatever the rows beside it see.
            with T.Kernel(nqb, splits, threads=threads, prelude=_RELU_PRELUDE if relu_max else None) as (bx, by):
                q_s = T.alloc_shared([block_q * heads, dim], dtype)
                k_s = T.alloc_shared([block_k, dim], dtype)
                s = T.alloc_fragment([block_k, block_q * heads], acc)
                s3 = T.reshape(s, (block_k, block_q, heads))
                w_f = T.alloc_fragment([block_q, heads], acc)
                red = T.alloc_fragment([block_k, block_q], acc)
                out_s = T.alloc_shared([block_q, block_k], acc)
                ks_s = T.alloc_shared([block_k], acc) if fp8 else None  # key scales of the block
                qb, lo, hi = cta_key_blocks(BlkLo, BlkHi, nqb, splits, width, block_k, bx, by)
                T.copy(Q[qb * block_q * heads : (qb + 1) * block_q * heads, :], q_s)
                T.copy(W[qb * block_q : (qb + 1) * block_q, :], w_f)
                for i in T.Pipelined(T.max(hi - lo, 0), num_stages=num_stages):
                    T.copy(K[(lo + i) * block_k : (lo + i + 1) * block_k, :], k_s)
                    if fp8:
                        # staged by the producer like the keys: a global read in the epilogue would be
                        # assigned to the producer warps by the warp-specialisation pass
                        T.copy(KScale[(lo + i) * block_k : (lo + i + 1) * block_k], ks_s)
                    T.gemm(k_s, q_s, s, transpose_B=True, clear_accum=True, policy=policy)
                    for a, b, h in T.Parallel(block_k, block_q, heads):
                        # not T.max(s, 0): fmaxf would turn a NaN score into 0
                        if relu_max:
                            s3[a, b, h] = T.call_extern(acc, "dsa_relu_keep_nan", s3[a, b, h]) * w_f[b, h]
                        else:
                            s3[a, b, h] = T.if_then_else(s3[a, b, h] < 0.0, 0.0, s3[a, b, h]) * w_f[b, h]
                    T.reduce_sum(s3, red, dim=-1, clear=True)
                    for b, a in T.Parallel(block_q, block_k):
                        out_s[b, a] = red[a, b] * ks_s[a] if fp8 else red[a, b]
                    # (storing straight from registers instead of this TMA store measured 5-9% slower)
                    T.copy(
                        out_s,
                        Scores[
                            qb * block_q : (qb + 1) * block_q,
                            (lo + i - BlkLo[qb]) * block_k : (lo + i - BlkLo[qb] + 1) * block_k,
                        ],
                    )

        return main

    @tilelang.jit
    def indexer_scores_pp(heads: int, dim: int, block_q: int, block_k: int, fp8: bool = False,
                          producer_regs: int = 24, consumer_regs: int = 240):
        # The same scores as indexer_scores, warp-specialised by hand so that one consumer's epilogue (relu,
        # weights, head sum, store) runs while the other's MMAs hold the tensor cores: consumer g (128 threads)
        # takes the key blocks i = g (mod 2) whole (block_k keys x all block_q * heads columns), and the two
        # issue their MMAs in turn (named barriers), so they never run their epilogues side by side. The
        # producer warpgroup loads Q once and the key blocks into four stages (two per consumer) by TMA.
        nq = T.dynamic("nq")
        nk = T.dynamic("nk")
        nks = T.dynamic("nks")
        width = T.dynamic("width")
        nqb = T.dynamic("nqb")
        dtype = T.float8_e4m3fn if fp8 else T.bfloat16
        acc = T.float32
        cols = block_q * heads
        turn = (10, 11)  # consumer g waits on turn[g] for the other's MMA issue
        out_bar = (12, 13)  # consumer g's own 128 threads, around its output tile

        @T.macro
        def consumer(g, Q, W, Scores, q_s, k_st, ks_st, out_s, ready, free, bar_q, s, s3, w_f, red, qb, lo, n,
                     BlkLo):
            T.copy(W[qb * block_q : (qb + 1) * block_q, :], w_f)
            T.mbarrier_wait_parity(bar_q, 0)
            if g == 1:  # consumer 0 issues the first block's MMAs without waiting
                T.named_barrier_arrive(turn[0], 256)
            for u in T.serial(T.ceildiv(n, 4)):
                for jj in (0, 1):  # a tuple: Python unrolls it (stages g and g + 2)
                    j = g + 2 * jj  # stage of block 4u + j
                    if 4 * u + j < n:
                        T.mbarrier_wait_parity(ready[j], u & 1)
                        T.sync_threads(turn[g], 256)
                        T.wgmma_gemm(k_st[j], q_s, s, transpose_B=True, clear_accum=True)
                        T.named_barrier_arrive(turn[1 - g], 256)
                        T.wait_wgmma(0)
                        if not fp8:  # the stage is free once its MMAs are done (fp8: its key scales are read below)
                            T.barrier_arrive(free[j])
                        for a, b, h in T.Parallel(block_k, block_q, heads):
                            s3[a, b, h] = T.call_extern(acc, "dsa_relu_keep_nan", s3[a, b, h]) * w_f[b, h]
                        T.reduce_sum(s3, red, dim=-1, clear=True)
                        T.tma_store_wait()  # the previous tile left out_s
                        T.sync_threads(out_bar[g], 128)
                        for b, a in T.Parallel(block_q, block_k):
                            out_s[b, a] = red[a, b] * ks_st[j][a] if fp8 else red[a, b]
                        if fp8:
                            T.barrier_arrive(free[j])
                        T.fence_proxy_async()
                        T.sync_threads(out_bar[g], 128)
                        blk = lo + 4 * u + j - BlkLo[qb]
                        T.tma_copy(out_s, Scores[qb * block_q : (qb + 1) * block_q,
                                                 blk * block_k : (blk + 1) * block_k], leader_scope_threads=128)
            # the turn handed on after the last block (or consumer 1's first, when there is none) is taken, so
            # that no arrival is left on a named barrier: n even, consumer 1's to consumer 0; n odd, the reverse
            if (n % 2) == (1 if g == 1 else 0):
                T.sync_threads(turn[g], 256)
            T.tma_store_wait()

        @T.prim_func
        def main(
            Q: T.Tensor([nq * heads, dim], dtype),
            K: T.Tensor([nk, dim], dtype),
            W: T.Tensor([nq, heads], acc),
            KScale: T.Tensor([nks], acc),
            BlkLo: T.Tensor([nqb], T.int32),
            BlkHi: T.Tensor([nqb], T.int32),
            splits: T.int32,
            Scores: T.Tensor([nq, width], acc),
        ):
            with T.Kernel(nqb, splits, threads=384, prelude=_RELU_PRELUDE) as (bx, by):
                q_s = T.alloc_shared([cols, dim], dtype)
                k_st = [T.alloc_shared([block_k, dim], dtype) for _ in range(4)]
                ks_st = [T.alloc_shared([block_k], acc) for _ in range(4)] if fp8 else [None] * 4
                out_s = [T.alloc_shared([block_q, block_k], acc) for _ in range(2)]
                bar_q = T.alloc_barrier(1)
                ready = [T.alloc_barrier(1) for _ in range(4)]
                free = [T.alloc_barrier(128) for _ in range(4)]
                s0 = T.alloc_fragment([block_k, cols], acc)
                s1 = T.alloc_fragment([block_k, cols], acc)
                w0 = T.alloc_fragment([block_q, heads], acc)
                w1 = T.alloc_fragment([block_q, heads], acc)
                red0 = T.alloc_fragment([block_k, block_q], acc)
                red1 = T.alloc_fragment([block_k, block_q], acc)
                tx = T.get_thread_binding()
                qb, lo, hi = cta_key_blocks(BlkLo, BlkHi, nqb, splits, width, block_k, bx, by)
                n = T.max(hi - lo, 0)
                if tx >= 256:
                    T.set_max_nreg(producer_regs, 0)
                    T.tma_copy(Q[qb * cols : (qb + 1) * cols, :], q_s, barrier=bar_q, leader_scope_threads=128)
                    if T.shuffle_elect(128):
                        T.barrier_arrive(bar_q)
                    for u in T.serial(T.ceildiv(n, 4)):
                        for j in (0, 1, 2, 3):  # a tuple: Python unrolls it (stage j is a buffer of its own)
                            if 4 * u + j < n:
                                T.mbarrier_wait_parity(free[j], (u & 1) ^ 1)
                                T.tma_copy(K[(lo + 4 * u + j) * block_k : (lo + 4 * u + j + 1) * block_k, :], k_st[j],
                                           barrier=ready[j], leader_scope_threads=128)
                                if fp8:
                                    T.tma_copy(KScale[(lo + 4 * u + j) * block_k : (lo + 4 * u + j + 1) * block_k],
                                               ks_st[j], barrier=ready[j], leader_scope_threads=128)
                                if T.shuffle_elect(128):
                                    T.barrier_arrive(ready[j])
                elif tx < 128:
                    T.set_max_nreg(consumer_regs, 1)
                    consumer(0, Q, W, Scores, q_s, k_st, ks_st, out_s[0], ready, free, bar_q, s0,
                             T.reshape(s0, (block_k, block_q, heads)), w0, red0, qb, lo, n, BlkLo)
                else:
                    T.set_max_nreg(consumer_regs, 1)
                    consumer(1, Q, W, Scores, q_s, k_st, ks_st, out_s[1], ready, free, bar_q, s1,
                             T.reshape(s1, (block_k, block_q, heads)), w1, red1, qb, lo, n, BlkLo)

        return main

    @tilelang.jit
    def block_ranges(block_q: int, block_k: int, threads: int = 128):
        """Windows -> per query block key-block ranges, in one launch (the plan of every call).

        KS/KE [nw] int32 windows -> per query block Lo/Hi [nqb]: the key blocks [Lo, Hi) covering
        its rows' non-empty windows (0, 0 when all are empty); per row Base [nq] = Lo * block_k, the
        key of its first score column, and KSo/KEo the window clamped to [0, n_keys] relative to
        Base (0, 0 when empty). Off [nq]: what the top-k adds to a score column, Base, or with
        entry-relative windows (rows_per_entry > 0: row r is row r % rows_per_entry of batch entry
        r // rows_per_entry, whose keys are global rows [e * keys_per_entry, (e + 1) * keys_per_entry);
        its window KS/KE[r % nw] counts that entry's keys, clamped to them) Base less the entry's first key:
        the selection in the entry's own columns. nw is nq, or rows_per_entry (one set of windows for
        every entry). HiScored [nqb]: the Hi the score program takes: Lo for a query block none of whose
        windows holds more than ``select_all_max`` keys (each of its rows selects its whole window, so
        its scores are never read: -1 scores every block), else Hi."""
        nq = T.dynamic("nq")
        nw = T.dynamic("nw")
        nqb = T.dynamic("nqb")
        i32 = T.int32
        big = 2**31 - 1

        @T.prim_func
        def main(
            KS: T.Tensor([nw], i32),
            KE: T.Tensor([nw], i32),
            n_keys: i32,
            rows_per_entry: i32,
            keys_per_entry: i32,
            select_all_max: i32,
            KSo: T.Tensor([nq], i32),
            KEo: T.Tensor([nq], i32),
            Base: T.Tensor([nq], i32),
            Off: T.Tensor([nq], i32),
            Lo: T.Tensor([nqb], i32),
            Hi: T.Tensor([nqb], i32),
            HiScored: T.Tensor([nqb], i32),
        ):
            with T.Kernel(T.ceildiv(nqb, threads), threads=threads) as bx:
                tx = T.get_thread_binding()
                qb = bx * threads + tx
                lo = T.alloc_var(i32, init=big)
                hi = T.alloc_var(i32, init=0)
                longest = T.alloc_var(i32, init=0)  # the block's longest window
                # each row's window in global key rows (clamped, start <= end) and its entry's first key (0
                # without entry-relative windows), found once: both loads issued before either is used
                st = T.alloc_local([block_q], i32)
                en = T.alloc_local([block_q], i32)
                first = T.alloc_local([block_q], i32)
                wrow = T.alloc_local([1], i32)  # the row's window: row, or row % nw (windows shared by the entries)
                lim = T.if_then_else(rows_per_entry > 0, keys_per_entry, n_keys)
                if qb < nqb:
                    for r in T.unroll(block_q):
                        row = qb * block_q + r
                        if row < nq:
                            first[r] = T.if_then_else(rows_per_entry > 0,
                                                      row // T.max(rows_per_entry, 1) * keys_per_entry, 0)
                            wrow[0] = T.if_then_else(nw == nq, row, row % nw)
                            st[r] = KS[wrow[0]]
                            en[r] = KE[wrow[0]]
                            st[r] = T.min(T.max(st[r], 0), lim)
                            en[r] = T.max(T.min(T.max(en[r], 0), lim), st[r]) + first[r]
                            st[r] = st[r] + first[r]
                            if en[r] > st[r]:
                                lo = T.min(lo, st[r])
                                hi = T.max(hi, en[r])
                                longest = T.max(longest, en[r] - st[r])
                    blo = T.if_then_else(hi > 0, lo // block_k, 0)
                    bhi = T.if_then_else(hi > 0, (hi + block_k - 1) // block_k, 0)
                    Lo[qb] = blo
                    Hi[qb] = bhi
                    HiScored[qb] = T.if_then_else(longest > select_all_max, bhi, blo)
                    for r in T.unroll(block_q):
                        row = qb * block_q + r
                        if row < nq:
                            Base[row] = blo * block_k
                            Off[row] = blo * block_k - first[r]
                            KSo[row] = T.if_then_else(en[r] > st[r], st[r] - blo * block_k, 0)
                            KEo[row] = T.if_then_else(en[r] > st[r], en[r] - blo * block_k, 0)

        return main

    @T.macro
    def relu_grad_tile(k_s, q_s, s, s3, di_s, w_s, g_s, block_k, block_q, heads):
        # S = K_blk Q^T (keys as rows, as indexer_scores), then G[a, (b, h)] = DI[b, a] (times W[b, h] when
        # w_s is given) where S > 0 (a NaN S passes it, as torch's relu gradient), else 0, in bf16
        T.gemm(k_s, q_s, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        for a, b, h in T.Parallel(block_k, block_q, heads):
            g_s[a, b * heads + h] = T.if_then_else(
                s3[a, b, h] <= 0.0, 0.0, di_s[b, a] if w_s is None else di_s[b, a] * w_s[b, h])

    @tilelang.jit
    def score_grads_query(heads: int, dim: int, block_q: int, block_k: int, threads: int, num_stages: int):
        """The scores' gradient towards index_q and the weights, query-major (one CTA per ``block_q`` rows).

        DI [nq, width] fp32: d objective / d I in the score buffer's layout (a block's columns start at its
        key block BlkLo; 0 outside the windows). Per key block: S = K_blk Q^T as in indexer_scores, then
        G[a, (b, h)] = DI[b, a] where S > 0 (a NaN S passes it, as torch's relu gradient), else 0, in
        bf16, and A[(b, h)] += G^T K_blk. Then DQ = A * W (bf16) and DW = <A, Q> (sum_s DI relu(S) =
        <sum_s DI [S > 0] k_s, q>: the weights stay out of the bf16 G)."""
        nq = T.dynamic("nq")
        nk = T.dynamic("nk")
        width = T.dynamic("width")
        nqb = T.dynamic("nqb")
        dtype, acc = T.bfloat16, T.float32
        n = block_q * heads

        @T.prim_func
        def main(
            Q: T.Tensor([nq * heads, dim], dtype),
            K: T.Tensor([nk, dim], dtype),
            W: T.Tensor([nq, heads], acc),
            DI: T.Tensor([nq, width], acc),
            BlkLo: T.Tensor([nqb], T.int32),
            BlkHi: T.Tensor([nqb], T.int32),
            DQ: T.Tensor([nq * heads, dim], dtype),
            DW: T.Tensor([nq, heads], acc),
        ):
            with T.Kernel(nqb, threads=threads) as bx:
                q_s = T.alloc_shared([n, dim], dtype)
                k_s = T.alloc_shared([block_k, dim], dtype)
                w_s = T.alloc_shared([block_q, heads], acc)
                di_s = T.alloc_shared([block_q, block_k], acc)
                g_s = T.alloc_shared([block_k, n], dtype)
                out_s = T.alloc_shared([n, dim], dtype)
                s = T.alloc_fragment([block_k, n], acc)
                s3 = T.reshape(s, (block_k, block_q, heads))
                a_f = T.alloc_fragment([n, dim], acc)
                dw_f = T.alloc_fragment([n], acc)
                qb = nqb - 1 - bx  # last blocks first: under a causal mask they walk the most keys
                lo = BlkLo[qb]
                hi = T.min(BlkHi[qb], lo + width // block_k)
                T.copy(Q[qb * n : (qb + 1) * n, :], q_s)
                T.copy(W[qb * block_q : (qb + 1) * block_q, :], w_s)
                T.clear(a_f)
                for i in T.Pipelined(T.max(hi - lo, 0), num_stages=num_stages):
                    T.copy(K[(lo + i) * block_k : (lo + i + 1) * block_k, :], k_s)
                    T.copy(DI[qb * block_q : (qb + 1) * block_q, i * block_k : (i + 1) * block_k], di_s)
                    relu_grad_tile(k_s, q_s, s, s3, di_s, None, g_s, block_k, block_q, heads)
                    T.gemm(g_s, k_s, a_f, transpose_A=True)
                for r, d in T.Parallel(n, dim):
                    out_s[r, d] = a_f[r, d] * w_s[r // heads, r % heads]
                for r, d in T.Parallel(n, dim):
                    a_f[r, d] = a_f[r, d] * q_s[r, d]
                T.reduce_sum(a_f, dw_f, dim=1)
                T.copy(out_s, DQ[qb * n : (qb + 1) * n, :])
                for r in T.Parallel(n):
                    if qb * block_q + r // heads < nq:
                        DW[qb * block_q + r // heads, r % heads] = dw_f[r]

        return main

    @tilelang.jit
    def score_grads_key(heads: int, dim: int, block_q: int, block_k: int, threads: int, num_stages: int):
        """The scores' gradient towards index_k, key-major: no atomics, so the sums are reproducible.

        Grid (key blocks, splits). Key block bx walks the query blocks that score it, listed by the caller
        in Ent[Ptr[bx] : Ptr[bx + 1]] with their DI column block in Col; split ``by`` takes the by-th part
        of that list and writes its partial sum to DK[by, bx * block_k ...] (the caller adds the splits
        in order). Per query block: S = K_blk Q_blk^T, G = DI[b, a] * W[b, h] where S > 0,
        else 0 (bf16), DK += G Q_blk."""
        nq = T.dynamic("nq")
        nk = T.dynamic("nk")
        width = T.dynamic("width")
        nkb = T.dynamic("nkb")
        nent = T.dynamic("nent")
        nsplit = T.dynamic("nsplit")
        dtype, acc = T.bfloat16, T.float32
        n = block_q * heads

        @T.prim_func
        def main(
            Q: T.Tensor([nq * heads, dim], dtype),
            K: T.Tensor([nk, dim], dtype),
            W: T.Tensor([nq, heads], acc),
            DI: T.Tensor([nq, width], acc),
            Ptr: T.Tensor([nkb + 1], T.int32),
            Ent: T.Tensor([nent], T.int32),
            Col: T.Tensor([nent], T.int32),
            DK: T.Tensor([nsplit, nkb * block_k, dim], acc),
        ):
            with T.Kernel(nkb, nsplit, threads=threads) as (bx, by):
                k_s = T.alloc_shared([block_k, dim], dtype)
                q_s = T.alloc_shared([n, dim], dtype)
                w_s = T.alloc_shared([block_q, heads], acc)
                di_s = T.alloc_shared([block_q, block_k], acc)
                g_s = T.alloc_shared([block_k, n], dtype)
                s = T.alloc_fragment([block_k, n], acc)
                s3 = T.reshape(s, (block_k, block_q, heads))
                dk = T.alloc_fragment([block_k, dim], acc)
                p0 = Ptr[bx]
                per = T.ceildiv(Ptr[bx + 1] - p0, nsplit)
                lo = p0 + by * per
                hi = T.min(Ptr[bx + 1], lo + per)
                T.copy(K[bx * block_k : (bx + 1) * block_k, :], k_s)
                T.clear(dk)
                for j in T.Pipelined(T.max(hi - lo, 0), num_stages=num_stages):
                    T.copy(Q[Ent[lo + j] * n : (Ent[lo + j] + 1) * n, :], q_s)
                    T.copy(W[Ent[lo + j] * block_q : (Ent[lo + j] + 1) * block_q, :], w_s)
                    T.copy(DI[Ent[lo + j] * block_q : (Ent[lo + j] + 1) * block_q,
                              Col[lo + j] * block_k : (Col[lo + j] + 1) * block_k], di_s)
                    relu_grad_tile(k_s, q_s, s, s3, di_s, w_s, g_s, block_k, block_q, heads)
                    T.gemm(g_s, q_s, dk)
                T.copy(dk, DK[by, bx * block_k : (bx + 1) * block_k, :])

        return main

    return {"indexer_scores": indexer_scores, "indexer_scores_pp": indexer_scores_pp, "block_ranges": block_ranges,
            "score_grads_query": score_grads_query,
            "score_grads_key": score_grads_key}


def _norm_config(config: dict) -> tuple:
    """The full configuration key of ``config`` (missing keys from the defaults). Asked on every call
    (the plan, then the program's lookup): worked out once per distinct config."""
    try:
        return _norm_config_items(tuple(sorted(config.items())))
    except TypeError:  # an unhashable value: worked out without the cache
        return _norm_config_items.__wrapped__(tuple(config.items()))


@functools.lru_cache(maxsize=256)
def _norm_config_items(items: tuple) -> tuple:
    cfg = dict(items)
    missing = [k for k in _CFG_KEYS if k not in cfg]
    if missing:  # (a configuration names the hand-specialised program itself: filled from the tiled ones)
        cfg = {**default_config(cfg["heads"], cfg["dim"], bool(cfg.get("fp8", False)), tiled=True), **cfg}
    cfg.setdefault("split_n", False)
    cfg.setdefault("fp8", False)
    # relu_max: the relu as one max.NaN (_RELU_PRELUDE) instead of a compare and a select per score: the consumers'
    # loop 687 -> 559 instructions (Hi 64, sm_90a SASS); H100, same process, the same sets: scores 1.04-1.06x bf16
    # and 1.08x fp8 at T 8K, indexer + top-k 1.02-1.04x bf16, 1.07x fp8
    cfg["relu_max"] = True if cfg.get("relu_max") is None else cfg["relu_max"]
    cfg.setdefault("pingpong", False)
    return tuple((k, (bool(cfg[k]) if k in ("ws", "split_n", "fp8", "relu_max", "pingpong") else int(cfg[k])))
                 for k in _CFG_KEYS)


_BUILD_LOCK = threading.Lock()
_BUILT: dict = {}


def _compiled(program: str, key: tuple, params: dict, target, pass_configs=None):
    """The compiled ``program`` of :func:`_factory` for ``params`` and ``target``, built once per key."""
    import tilelang

    key = (program, key, repr(target))
    kern = _BUILT.get(key)
    if kern is None:
        announce_compile(f"indexer {program}")
        with _BUILD_LOCK:  # TIR construction is not thread-safe; nvcc below runs in parallel
            tir = _factory()[program].get_tir(**params)
        kern = tilelang.compile(tir, target=target if target is not None else "auto", pass_configs=pass_configs)
        logger.info("compiled TileLang %s %s target=%s", program, params, key[2])
        with _BUILD_LOCK:
            kern = _BUILT.setdefault(key, kern)
    return kern


def build_indexer(config: dict, target=None):
    """Compile the score kernel for ``config`` (a SHIPPED_CONFIGS-like dict) and ``target``
    (default: the current CUDA device; ``{"kind": "cuda", "arch": "sm_90a"}`` compiles on CPU)."""
    key = _norm_config(config)
    params = dict(key)
    ws = params.pop("ws")
    if params.pop("pingpong"):
        if not params["relu_max"] or params["split_n"] or params["block_k"] != 64:
            raise ValueError(f"the pingpong score program takes block_k 64, relu_max and no split_n, got {config}")
        # warp-specialised by hand (its own barriers): neither TileLang's specialisation nor its syncs
        import tilelang

        pp = {k: params[k] for k in ("heads", "dim", "block_q", "block_k", "fp8")}
        return _compiled("indexer_scores_pp", key, pp, target,
                         {**_pass_configs(False), tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True})
    return _compiled("indexer_scores", key, params, target, _pass_configs(ws))


def grad_config(score_config: dict) -> dict:
    """The tiling of the score-gradient programs for buffers written with ``score_config``: its key
    blocks (DI columns come in its tiles) and as many of a score block's rows as keep block_q * heads
    <= 128 (two accumulators of [128, 128] fp32 per 256 threads)."""
    cfg = dict(_norm_config(score_config))
    block_q = cfg["block_q"]
    while block_q > 1 and (block_q * cfg["heads"] > 128 or cfg["block_q"] % block_q):
        block_q -= 1
    return {"heads": cfg["heads"], "dim": cfg["dim"], "block_q": block_q, "block_k": cfg["block_k"],
            "threads": cfg["threads"], "num_stages": 2}


#: The score-gradient programs shipped (the dense warm-up loss): one pair per bf16 tiling it scores with.
GRAD_CONFIGS: list = [grad_config(c) for c in TILED_CONFIGS if not c.get("fp8")]


def build_score_grads(side: str, config: dict, target=None):
    """Compile ``score_grads_query`` (side "query") or ``score_grads_key`` ("key") for a GRAD_CONFIGS-like
    dict and ``target`` (default: the current CUDA device)."""
    if side not in ("query", "key"):
        raise ValueError(f"side must be 'query' or 'key', got {side!r}")
    params = {k: int(config[k]) for k in ("heads", "dim", "block_q", "block_k", "threads", "num_stages")}
    return _compiled(f"score_grads_{side}", tuple(params.items()), params, target, _pass_configs(True))


def build_block_ranges(block_q: int, block_k: int, target=None):
    """Compile the plan program (windows -> key-block ranges) for a (block_q, block_k) tiling."""
    params = {"block_q": int(block_q), "block_k": int(block_k)}
    return _compiled("block_ranges", tuple(params.items()), params, target)


def build_all(target=None):
    """Compile every shipped configuration (indexer scores, their plan programs and radix top-k)."""
    out = [build_indexer(cfg, target=target) for cfg in SHIPPED_CONFIGS]
    out += [build_block_ranges(bq, bk, target=target)
            for bq, bk in sorted({(c["block_q"], c["block_k"]) for c in SHIPPED_CONFIGS})]
    out += _topk.build_all(target=target)
    return out


def _check(name, t, dtype, dim):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype or not t.is_cuda:
        raise ValueError(f"{name} must be {dtype} on a CUDA device, got {t.dtype} on {t.device}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dims, got shape {tuple(t.shape)}")


def _plan_chunks(lo: np.ndarray, hi: np.ndarray, rows_per_block: int, block_k: int, max_bytes: int):
    """Split the query blocks into chunks whose score buffer stays under ``max_bytes``.

    lo/hi: per query block, key-block range [lo, hi) (hi <= lo means nothing to compute). A row's
    buffer columns start at its block's ``lo``, so a chunk is as wide as its widest block.
    Returns a list of (qb_start, qb_end, width_blocks).
    """
    width = np.maximum(np.asarray(hi, dtype=np.int64) - np.asarray(lo, dtype=np.int64), 0)
    nqb = width.shape[0]
    chunks = []
    a = 0
    while a < nqb:
        span = min(nqb - a, 1 << 16)  # look ahead over a bounded window, vectorised
        run = np.maximum.accumulate(width[a : a + span])
        nbytes = np.arange(1, span + 1, dtype=np.int64) * rows_per_block * run * block_k * 4
        ok = np.nonzero(nbytes <= max_bytes)[0]  # nbytes is non-decreasing, so ok is a prefix
        n = int(ok[-1]) + 1 if ok.size else 1
        chunks.append((a, a + n, int(run[n - 1])))
        a += n
    return chunks


def unsupported_reason(num_heads: int, head_dim: int, topk: int, dtype=None):
    """None when the TileLang indexer handles these sizes, else a one-line reason."""
    import torch

    if dtype is not None and dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return f"the TileLang indexer takes bfloat16 or float8_e4m3fn index_q/index_k, got {dtype}"
    if num_heads not in (8, 16, 32, 64, 128):
        return f"the TileLang indexer supports 8, 16, 32, 64 or 128 index heads, got {num_heads}"
    if head_dim % 16 != 0 or not 16 <= head_dim <= 256:
        return f"the TileLang indexer needs a head dim that is a multiple of 16 in [16, 256], got {head_dim}"
    if dtype == torch.float8_e4m3fn and head_dim % 32 != 0:
        return f"the fp8 TileLang indexer needs a head dim that is a multiple of 32, got {head_dim}"
    if topk < 1:
        return f"topk must be >= 1, got {topk}"
    return None


@functools.lru_cache(maxsize=None)
def _unit_scale(device):
    """A one-element fp32 placeholder for the KScale argument of the bf16 programs (never read)."""
    import torch

    return torch.ones(1, dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(query_blocks: int, width_blocks: int, device, one_row_blocks: bool = False) -> int:
    """Key-range splits per query block: 1 when the query blocks alone fill the GPU (prefill); with few query
    blocks each block's key range is cut into parts, at least one key block per part.

    Blocks of several rows: about four CTAs per SM, rounded up (H100, B 32 over 32K-128K caches: 3-4% faster than
    two per SM). ``one_row_blocks`` (the generation-step tiling, one row per CTA): at most two CTAs per SM, rounded
    down, so the grid is one wave. H200, GLM-5's 32 index heads, the scores alone against the four-per-SM rule
    (whose last CTAs, past one wave, ran alone): B 1 x 128K 1.29 / 1.33x (bf16 / fp8 keys), B 8 1.10 / 1.24x at
    32K and 1.02 / 1.06x at 128K, B 32 1.02 / 1.07x and 1.04 / 1.08x, B 64 x 32K 1.16 / 1.07x; never slower where
    measured (B 1-64; ab_indexer_decode.py, indexer_decode.md)."""
    target = (2 if one_row_blocks else 4) * _sm_count(device)
    if query_blocks >= target:
        return 1
    qb = max(query_blocks, 1)
    return max(1, min(target // qb if one_row_blocks else -(-target // qb), width_blocks))


class _Plan:
    """Inputs normalised once, per-query-block key ranges, and the chunk split: one chunk when the whole
    buffer fits ``max_chunk_bytes``; otherwise chunks sized from the windows' block ranges (one host sync),
    or with ``sync_free`` from the sizes alone (every chunk as wide as the whole key range).
    ``entry_windows`` (with ``entries``): the windows count each batch entry's own keys, [Tq] or one set
    [rows per entry] for every entry, and the top-k writes the entry's own columns (see indexer_topk).
    ``select_all_max``: query blocks whose windows all hold at most this many keys are not scored (the top-k
    takes a row's whole window without reading its scores when it holds at most k keys); -1 scores every block
    (the losses read every score)."""

    def __init__(self, index_q, index_k, weights, key_start, key_end, config, max_chunk_bytes, index_k_scale=None,
                 entries=None, sync_free=False, entry_windows=False, select_all_max=-1):
        import torch

        fp8 = isinstance(index_q, torch.Tensor) and index_q.dtype == torch.float8_e4m3fn
        qk_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        _check("index_q", index_q, qk_dtype, 3)
        _check("index_k", index_k, qk_dtype, 2)
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise ValueError("weights must be a floating-point tensor")
        Tq, Hi, Di = index_q.shape
        Tk = index_k.shape[0]
        if index_k.shape[1] != Di:
            raise ValueError(f"index_k must be [Tk, {Di}], got {tuple(index_k.shape)}")
        if tuple(weights.shape) != (Tq, Hi):
            raise ValueError(f"weights must be [{Tq}, {Hi}], got {tuple(weights.shape)}")
        if weights.device != index_q.device or index_k.device != index_q.device:
            raise ValueError("index_q, index_k and weights must be on the same device")
        rows_per_entry, keys_per_entry = (0, 0) if entries is None else (int(v) for v in entries)
        # (entries of no keys: Tk 0, every row gets -1)
        if entries is not None and (rows_per_entry < 1 or keys_per_entry < 0 or Tq % rows_per_entry
                                    or Tk != Tq // rows_per_entry * keys_per_entry):
            raise ValueError(f"entries=({rows_per_entry}, {keys_per_entry}) must split the {Tq} query rows and "
                             f"{Tk} keys into the same number of batch entries")
        if entry_windows and entries is None:
            raise ValueError("entry_windows needs entries=(rows, keys) per batch entry")
        n_windows = (Tq, rows_per_entry) if entry_windows else (Tq,)
        for name, t in (("key_start", key_start), ("key_end", key_end)):
            _check(name, t, torch.int32, 1)
            if t.shape[0] not in n_windows:
                raise ValueError(f"{name} must be [{' or '.join(map(str, n_windows))}], got {tuple(t.shape)}")
        self.Tq, self.Hi, self.Di, self.Tk = Tq, Hi, Di, Tk
        self.device = index_q.device
        if fp8:
            if index_k_scale is None:
                self.k_scale = torch.ones(Tk, dtype=torch.float32, device=self.device)
            else:
                _check("index_k_scale", index_k_scale, torch.float32, 1)
                if index_k_scale.shape[0] != Tk or index_k_scale.device != self.device:
                    raise ValueError(f"index_k_scale must be [{Tk}] on {self.device}, got {tuple(index_k_scale.shape)} "
                                     f"on {index_k_scale.device}")
                self.k_scale = aligned_operand(index_k_scale)  # the program loads it with TMA
        elif index_k_scale is not None:
            raise ValueError("index_k_scale is for float8_e4m3fn index_q/index_k; bfloat16 keys take no scale")
        else:
            self.k_scale = _unit_scale(self.device)  # not read without fp8
        if config is not None and "fp8" not in config:
            config = {**config, "fp8": fp8}  # a partial config takes the input's precision
        cfg = dict(_norm_config(config if config is not None else default_config(Hi, Di, fp8, rows=Tq)))
        if cfg["heads"] != Hi or cfg["dim"] != Di or cfg["fp8"] != fp8:
            raise ValueError(f"config is for heads={cfg['heads']} dim={cfg['dim']} fp8={cfg['fp8']}, inputs have "
                             f"{Hi}, {Di}, {index_q.dtype}")
        self.cfg = cfg
        bq, bk = cfg["block_q"], cfg["block_k"]
        self.bq, self.bk = bq, bk
        # aligned bases: the programs read them by TMA and vector loads (a misaligned view is copied)
        self.q = aligned_operand(index_q).view(Tq * Hi, Di)
        self.k = aligned_operand(index_k)
        self.w = aligned_operand(weights.float())
        self.chunks = []
        nqb = (Tq + bq - 1) // bq
        self.ks = torch.empty(Tq, dtype=torch.int32, device=self.device)  # windows relative to base
        self.ke = torch.empty_like(self.ks)
        self.base = torch.empty_like(self.ks)  # key row of each row's first score column
        self.off = torch.empty_like(self.ks)  # what the top-k adds to a score column (entry_windows: entry-local)
        self.blk_lo = torch.empty(nqb, dtype=torch.int32, device=self.device)
        self.blk_hi = torch.empty_like(self.blk_lo)
        self.blk_hi_scored = torch.empty_like(self.blk_lo)  # blk_hi, or blk_lo where no row needs its scores
        if Tq == 0:
            return
        build_block_ranges(bq, bk)(key_start.contiguous(), key_end.contiguous(), Tk,
                                   rows_per_entry if entry_windows else 0, keys_per_entry, int(select_all_max),
                                   self.ks, self.ke, self.base, self.off, self.blk_lo, self.blk_hi, self.blk_hi_scored)
        if Tk == 0:
            return
        # Widest block range, known without looking at the windows: every key, or (batched layout)
        # the keys of the entries one block of rows can span, plus one block of misalignment
        width = (Tk + bk - 1) // bk
        if entries is not None:
            spanned = 1 if rows_per_entry % bq == 0 else -(-(bq - 1) // rows_per_entry) + 1
            width = min(width, -(-spanned * keys_per_entry // bk) + 1)
        if Tq * width * bk * 4 <= max_chunk_bytes:
            self.chunks = [(0, nqb, width)]  # one buffer: no host sync (CUDA-graph capturable)
        elif sync_free:
            # chunks of as many blocks as fit at the widest range, planned from the sizes alone: no host sync
            # (a causal chunk's buffer is wider than its rows need: more chunks than the windows would allow)
            per = max(1, max_chunk_bytes // (bq * width * bk * 4))
            self.chunks = [(a, min(a + per, nqb), width) for a in range(0, nqb, per)]
        else:
            lohi = torch.stack([self.blk_lo, self.blk_hi]).cpu().numpy()  # the one host sync
            self.chunks = _plan_chunks(lohi[0], lohi[1], bq, bk, max_chunk_bytes)

    def chunk_scores(self, chunk, scores=None):
        """Run the score kernel for one chunk; returns (row0, row1, scores or None). ``scores``: the
        [rows, width * block_k] fp32 buffer to write (default: a new one)."""
        import torch

        qb0, qb1, wblocks = chunk
        r0, r1 = qb0 * self.bq, min(qb1 * self.bq, self.Tq)
        if wblocks <= 0:
            return r0, r1, None
        if scores is None:
            scores = torch.empty(r1 - r0, wblocks * self.bk, dtype=torch.float32, device=self.device)
        kern = build_indexer(self.cfg)
        kern(self.q[r0 * self.Hi : r1 * self.Hi], self.k, self.w[r0:r1], self.k_scale, self.blk_lo[qb0:qb1],
             self.blk_hi_scored[qb0:qb1], _splits(qb1 - qb0, wblocks, self.device, one_row_blocks=self.bq == 1), scores)
        return r0, r1, scores

    def chunk_topk(self, r0, r1, scores, topk, out, config=None, lse=None):
        if scores is None:
            out[r0:r1].fill_(-1)
            return
        # score columns -> key rows (or the entry's own columns): + each row's offset; the top-k never reads
        # past the buffer (a window beyond the caller's bound is cut to it)
        _topk.topk_rows_ranges(scores, self.ks[r0:r1], self.ke[r0:r1], topk, row_offsets=self.off[r0:r1],
                               out=out[r0:r1], config=config, lse=None if lse is None else lse[r0:r1])


def indexer_topk(index_q, index_k, weights, key_start, key_end, topk: int, *, config=None,
                 max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES, topk_config=None, index_k_scale=None,
                 entries: tuple[int, int] | None = None, return_lse: bool = False, entry_windows: bool = False,
                 score_whole_windows: bool = False):
    """Lightning-indexer top-k over per-query key windows.

    index_q [Tq, Hi, Di] bf16 CUDA; index_k [Tk, Di] bf16; weights [Tq, Hi] fp32 (softmax
    scale already folded in; other float dtypes are converted); key_start, key_end [Tq]
    int32: query t may see the keys s with key_start[t] <= s < key_end[t] (global rows of
    index_k). Scores I[t, s] = sum_h relu(<index_q[t, h], index_k[s]>) * weights[t, h],
    accumulated in fp32. fp8: index_q and index_k float8_e4m3fn, index_k_scale [Tk] fp32
    (positive per-key scales, None = 1): I[t, s] = index_k_scale[s] * (the sum above); per-query
    or per-head q scales belong in weights. ``entries=(S, Tk_e)`` says the rows come from a batched
    layout: row t belongs to entry t // S and its window lies inside that entry's keys
    [e * Tk_e, (e + 1) * Tk_e); it bounds the score buffer without a host sync. A window outside
    its entry then gives a wrong selection: pass None when that does not hold. ``entry_windows`` (with
    ``entries``): the windows count the entry's own keys instead ([Tq], or [S]: the same windows for every
    entry), clamped to them, and the result holds the entry's own columns s - e * Tk_e (the batched layout
    of the ops, with no conversion before or after the launch).

    Returns [Tq, topk] int32: the rows s of the ``topk`` largest I[t, s] inside the window,
    -1 in the slots beyond the window size when the window holds fewer than ``topk`` keys.
    Order inside a row: ascending key order, -1 padding last (``topk.radix_finish``), whatever the
    configuration, chunking or rows beside it.
    Among equal scores the lowest key wins (-0.0 ties with +0.0), so a row's set depends on its own
    scores only, never on chunking, key-range splits or the rows packed beside it. Keys outside the
    window are never selected.

    Chunked design: at most ``max_chunk_bytes`` of fp32 scores exist at once. With few rows
    (generation steps) each CTA scores one row, so rows of different sequences never share work.

    ``return_lse``: also the logsumexp of each row's selected scores ([Tq] fp32, -inf for a row without
    a key), summed by the top-k program as it emits them: (rows, lse). The indexer KL loss takes it and
    skips its own pass over the logits.

    A row whose window holds at most ``topk`` keys selects all of them whatever its scores, so a block of such
    rows is not scored (a causal prefill's first ``topk`` rows, every step over a cache of at most ``topk``
    keys), unless ``return_lse`` (the lse sums their scores) or ``score_whole_windows`` (benchmarks: the cost of
    scoring them) asks for the scores.
    """
    import torch

    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    plan = _Plan(index_q, index_k, weights, key_start, key_end, config, max_chunk_bytes, index_k_scale, entries,
                 entry_windows=entry_windows, select_all_max=-1 if return_lse or score_whole_windows else topk)
    out = torch.empty(plan.Tq, topk, dtype=torch.int32, device=plan.device)
    lse = torch.full((plan.Tq,), float("-inf"), dtype=torch.float32, device=plan.device) if return_lse else None
    if plan.Tq == 0 or plan.Tk == 0:
        out.fill_(-1)
        return (out, lse) if return_lse else out
    for chunk in plan.chunks:
        r0, r1, scores = plan.chunk_scores(chunk)
        plan.chunk_topk(r0, r1, scores, topk, out, config=topk_config, lse=lse)
        del scores
    return (out, lse) if return_lse else out


def indexer_scores_reference(index_q, index_k, weights, key_start, key_end):
    """Dense fp32 torch reference of the windowed scores ([Tq, Tk], -inf outside the window).
    For tests on small sizes only."""
    import torch

    s = torch.einsum("thd,sd->tsh", index_q.float(), index_k.float()).relu()
    s = (s * weights.float()[:, None, :]).sum(-1)
    cols = torch.arange(index_k.shape[0], device=s.device)
    mask = (cols[None, :] >= key_start[:, None].long()) & (cols[None, :] < key_end[:, None].long())
    return s.masked_fill(~mask, float("-inf"))
