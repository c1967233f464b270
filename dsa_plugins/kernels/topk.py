"""Exact radix top-k over the rows of an fp32 score matrix (TileLang, Hopper).

One CTA per row (``radix_topk``), or for a few long rows one cluster of 4 or 8 CTAs per row
(``radix_topk_split``: each CTA takes a slice of the columns, the digit histograms are summed
through distributed shared memory). Scores are mapped to order-preserving uint32 keys and the
k-th largest key is found digit by digit (12 + 10 + 10 bits):

1. histogram of the top 12 bits over the row's valid columns (global memory);
2. a second read of the row emits every column whose top digit is above the threshold
   digit, and gathers the columns of the threshold digit into shared memory when they fit
   (``cap`` entries; otherwise the later rounds re-read the row from global memory);
3. two 10-bit rounds over that candidate set fix the exact 32-bit threshold key;
4. a last pass emits the candidates above the threshold, and every column of the threshold key
   when all of them are needed. When more columns share that key than are still needed, the row is
   left to a second program, ``radix_tie_fill``, which re-reads it in column order and ranks the
   ties with a block-wide prefix count: the lowest columns win. It is a program of its own because
   its scan would cost the select program registers (48 -> 82 at 256 threads) and occupancy; rows
   without excess ties leave it at once (H100: 0.005 ms for 64 rows, the select 0.027 ms).

The result is exact and canonical (DSA.md 2): the same set as a stable sort by score, descending,
where among equal scores the lowest column wins and -0.0 ties with +0.0. A row's selection so
depends on its own scores only, never on how rows are packed, chunked or launched.
The CTA size is chosen from the row count and length (``config_for_rows``). H200: 64 rows
x 32768, k 2048: 0.028 ms (torch.topk 0.114 ms); H100 with the tie rule: 0.027 + 0.005 ms.
Rows whose valid range holds at most ``topk`` columns return all of them followed by -1.
The order of the indices inside a row is unspecified (it is not sorted).

TileLang is imported lazily so that this module imports without TileLang or a GPU.

Size: one file for the family (the select programs and the tie-fill program share the key order,
the row loads, the digit search and the tie pass; the configurations and the wrappers sit with them).
"""

import functools
import logging
import threading

from . import announce_compile, unread_arg, zeros_arg
from .cluster import CLUSTER_PRELUDE

logger = logging.getLogger("dsa_plugins")

#: Compile-time configurations shipped (and compiled by the CPU test). ``topk`` and the
#: row count / length are run-time sizes; only the CTA shape is fixed.
SHIPPED_CONFIGS: list = [
    # 1024-thread CTA, warp-aggregated output slots
    {"threads": 1024, "cap": 8192, "unroll": 4, "agg": True},
    # 256-thread CTA: several rows share an SM (best for many rows of up to 32K columns)
    {"threads": 256, "cap": 2048, "unroll": 4, "agg": True},
    # 1024-thread CTA, per-element shared atomics (best when there are few rows)
    {"threads": 1024, "cap": 8192, "unroll": 4, "agg": False},
    # 512-thread CTA (best for many rows longer than 32K columns)
    {"threads": 512, "cap": 4096, "unroll": 4, "agg": True},
]
#: each also with ``lse``: it writes every row's logsumexp of the scores it selects (the indexer KL loss
#: takes it instead of recomputing the logits); ties at the threshold enter by count, so the tie-fill
#: program needs no change
SHIPPED_CONFIGS += [{**cfg, "lse": True} for cfg in SHIPPED_CONFIGS]
#: the split program (``parts`` CTAs per row, one cluster; no lse): few long rows, the generation steps.
#: H100, indexer-like scores, k 2048, select + tie-fill from a CUDA graph (one CTA per row -> split):
#: 1 x 131072 59.9 -> 29.9 us, 8 x 131072 56.5 -> 29.4, 16 x 131072 62.9 -> 37.8 (4 parts), 1 / 8 x 32768
#: 25.6 / 26.9 -> 22.8 / 23.1 (4 parts; 8 parts 26.8 / 27.2): both programs are a chain of latency-bound phases
#: of 20-25 us per row; past 16 rows the clusters no longer fit in one wave (32 x 32768: 25.6 -> 41.8)
SPLIT_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 8}
SPLIT4_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 4}
#: two CTAs per row still fit one wave up to 64 rows. H200, indexer-like scores, k 2048, one CTA per row -> two
#: parts: 32 x 65536 35.6 -> 31.1 us, 32 x 131072 55.6 -> 42.7, 64 x 131072 56.6 -> 43.9 (four parts of 512 or
#: 1024 threads lose past 16 rows: 32 x 131072 65.1 / 55.0; bench_topk_configs.py, logs/h200_topk_split2_*.log)
SPLIT2_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 2}
SHIPPED_CONFIGS += [SPLIT_CONFIG, SPLIT4_CONFIG, SPLIT2_CONFIG]

DEFAULT_CONFIG = SHIPPED_CONFIGS[2]
MANY_SHORT_ROWS_CONFIG = SHIPPED_CONFIGS[1]
MANY_LONG_ROWS_CONFIG = SHIPPED_CONFIGS[3]
#: with fewer rows than this one big CTA per row is best (rows < SMs); measured on H200
FEW_ROWS = 264
#: the split program's rows: up to SPLIT8_MAX_ROWS rows of at least SPLIT8_MIN_COLS columns take 8 parts; 4 parts
#: take up to SPLIT8_MAX_ROWS rows of at least SPLIT_MIN_COLS and up to SPLIT_MAX_ROWS of at least SPLIT8_MIN_COLS;
#: 2 parts up to SPLIT2_MAX_ROWS rows of at least SPLIT8_MIN_COLS
SPLIT_MAX_ROWS = 16
SPLIT2_MAX_ROWS = 64
SPLIT8_MAX_ROWS = 8
SPLIT_MIN_COLS = 32768
SPLIT8_MIN_COLS = 65536
SHORT_ROW_MAX = 32768


def config_for_rows(rows: int, max_cols: int, lse: bool = False) -> dict:
    """The configuration used for ``rows`` rows of at most ``max_cols`` columns (``lse``: one that writes it).

    Chosen from H200 timings: 64 x 32768 -> 1024 threads (0.028 ms); 8192 rows of <= 8K
    and thousands of rows of <= 32K -> 256 threads; rows of 64K -> 512 threads. A few long rows (generation
    steps) take the split program: each row over a cluster of 8, 4 or 2 CTAs."""
    if not lse and rows <= SPLIT_MAX_ROWS and max_cols >= SPLIT_MIN_COLS:
        if rows <= SPLIT8_MAX_ROWS and max_cols >= SPLIT8_MIN_COLS:
            return SPLIT_CONFIG
        if rows <= SPLIT8_MAX_ROWS or max_cols >= SPLIT8_MIN_COLS:
            return SPLIT4_CONFIG
    if not lse and rows <= SPLIT2_MAX_ROWS and max_cols >= SPLIT8_MIN_COLS:
        return SPLIT2_CONFIG
    if rows < FEW_ROWS:
        return DEFAULT_CONFIG
    return MANY_SHORT_ROWS_CONFIG if max_cols <= SHORT_ROW_MAX else MANY_LONG_ROWS_CONFIG


_NB1 = 4096  # bins of the first (12-bit) digit
_NB2 = 1024  # bins of the two later (10-bit) digits


def _pass_configs():
    import tilelang

    # Barriers are placed by hand: every one of them sits in block-uniform control flow.
    return {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}


def _row_macros(T, threads: int, unroll: int):
    """The pieces both programs share: the order-preserving key, the row loads, and the
    column-ordered tie pass (one row per CTA of ``threads`` threads, ``unroll`` float4 loads)."""
    u32 = T.uint32
    nwarps = threads // 32

    def ordered(x):
        # order-preserving uint32 key; -0.0 is keyed as +0.0 (they tie, as IEEE compares them)
        bits = T.if_then_else(
            T.reinterpret(x, u32) == T.uint32(0x80000000), T.uint32(0), T.reinterpret(x, u32)
        )
        return T.if_then_else(
            (bits >> T.uint32(31)) == T.uint32(1),
            bits ^ T.uint32(0xFFFFFFFF),
            bits | T.uint32(0x80000000),
        )

    @T.macro
    def load_chunk(S, bx, c0, c1, it, tx, vals):
        # `unroll` float4 loads per thread: columns [c0, c1) in units of 4, chunk `it`
        for u in T.unroll(unroll):
            if c0 + (it * unroll + u) * threads + tx < c1:
                for v in T.vectorized(4):
                    vals[u * 4 + v] = S[bx, c0 + (it * unroll + u) * threads + tx, v]

    @T.macro
    def emit_ties_in_column_order(S, bx, c0, c1, start, end, prefix, need, tx, vals, wsum, ctl, out_offset, Out,
                                  K):
        # The `need` lowest columns whose key equals `prefix` go to slots [K - need, K): the row is
        # re-read in column order ((it, u) steps; in one step thread tx holds 4 consecutive columns
        # and lower threads hold lower columns), and a block-wide exclusive scan of the per-thread
        # tie counts ranks every tie. ctl[5]: ties seen in earlier steps (block-uniform).
        cnt = T.alloc_var(T.int32)
        x = T.alloc_var(T.int32)
        c = T.alloc_var(T.int32)
        base = T.alloc_var(T.int32)
        r = T.alloc_var(T.int32)
        col = T.alloc_var(T.int32)
        for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
            if ctl[5] < need:
                load_chunk(S, bx, c0, c1, it, tx, vals)
                for u in T.unroll(unroll):
                    cnt = 0
                    for v in T.unroll(4):
                        col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                        if col >= start and col < end and ordered(vals[u * 4 + v]) == prefix:
                            cnt = cnt + 1
                    x = cnt
                    for s_ in T.unroll(5):
                        c = T.shfl_up(x, 1 << s_)
                        if (tx % 32) >= (1 << s_):
                            x = x + c
                    if tx % 32 == 31:
                        wsum[tx // 32] = x
                    T.sync_threads()
                    base = ctl[5] + x - cnt
                    for w in T.unroll(nwarps):
                        if w < tx // 32:
                            base = base + wsum[w]
                    r = 0
                    for v in T.unroll(4):
                        col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                        if col >= start and col < end and ordered(vals[u * 4 + v]) == prefix:
                            if base + r < need:
                                Out[bx, K - need + base + r] = col + out_offset
                            r = r + 1
                    T.sync_threads()
                    if tx == 0:
                        for w in T.unroll(nwarps):
                            ctl[5] = ctl[5] + wsum[w]
                    T.sync_threads()


    return ordered, load_chunk, emit_ties_in_column_order


def _threshold_macro(T, threads: int):
    """The digit search both select programs share (one CTA of ``threads`` threads)."""
    nwarps = threads // 32

    @T.macro
    def find_threshold(hist, wsum, ctl, tx, bpt, need):
        # Finds the digit d with  count(digit > d) < need <= count(digit >= d).
        # ctl[3] <- d, ctl[4] <- count(digit > d). Ends with a barrier.
        ls = T.alloc_var(T.int32)
        x = T.alloc_var(T.int32)
        run = T.alloc_var(T.int32)
        c = T.alloc_var(T.int32)
        ls = 0
        for j in T.serial(bpt):
            ls = ls + hist[tx * bpt + j]
        x = ls
        for s in T.unroll(5):
            c = T.shfl_down(x, 1 << s)
            if (tx % 32) + (1 << s) < 32:
                x = x + c
        if tx % 32 == 0:
            wsum[tx // 32] = x
        T.sync_threads()
        run = x - ls
        for w in T.unroll(nwarps):
            if w > tx // 32:
                run = run + wsum[w]
        for jj in T.serial(bpt):
            c = hist[tx * bpt + (bpt - 1 - jj)]
            if run < need and run + c >= need:
                ctl[3] = tx * bpt + (bpt - 1 - jj)
                ctl[4] = run
            run = run + c
        T.sync_threads()

    return find_threshold


# the split program: 4 consecutive histogram bins summed over the cluster's CTAs (16-byte loads from each peer's
# shared memory, all issued before the first add)
_SPLIT_PRELUDE = r"""
template <int kParts>
__device__ __forceinline__ void dsa_cluster_sum4(const int* hist, int* tot) {
  int4 v[kParts];
  #pragma unroll
  for (int p = 0; p < kParts; ++p)
    asm volatile("ld.shared::cluster.v4.b32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v[p].x), "=r"(v[p].y), "=r"(v[p].z), "=r"(v[p].w) : "r"(dsa_peer_addr(hist, p)) : "memory");
  int4 s = v[0];
  #pragma unroll
  for (int p = 1; p < kParts; ++p) { s.x += v[p].x; s.y += v[p].y; s.z += v[p].z; s.w += v[p].w; }
  *reinterpret_cast<int4*>(tot) = s;
}
"""


@functools.lru_cache(maxsize=None)
def _factory():
    """Build the @tilelang.jit factory (TileLang imported here, not at module import)."""
    import tilelang
    import tilelang.language as T

    @tilelang.jit(pass_configs=_pass_configs())
    def radix_topk(threads: int = 1024, cap: int = 8192, unroll: int = 4, agg: bool = False, lse: bool = False):
        assert threads % 32 == 0 and _NB2 % threads == 0, "threads must be a multiple of 32 dividing 1024"
        nwarps = threads // 32
        bpt1 = _NB1 // threads
        bpt2 = _NB2 // threads
        R = T.dynamic("R")
        n4 = T.dynamic("n4")
        K = T.dynamic("K")
        n_off = T.dynamic("n_off")  # R (one offset per row) or 1 (offset_stride 0: one for all)
        u32 = T.uint32
        i32 = T.int32
        ordered, load_chunk, _ = _row_macros(T, threads, unroll)

        find_threshold = _threshold_macro(T, threads)

        f32 = T.float32
        neg_inf = -T.infinity(f32)

        def unordered(key):
            # the float of an order-preserving key (the inverse of `ordered`; -0.0 comes back as +0.0)
            return T.reinterpret(T.if_then_else((key >> T.uint32(31)) == T.uint32(1), key & T.uint32(0x7FFFFFFF),
                                                key ^ T.uint32(0xFFFFFFFF)), f32)

        @T.macro
        def lse_add(run, x):
            # run[0], run[1]: this thread's running max and rescaled sum of exp over the selected scores it
            # emits (``lse``); a NaN score is passed over by the max but makes the sum NaN
            # (fmaxf drops a NaN, so a NaN is carried by the sum explicitly: once NaN, it stays NaN)
            m_old = run[0]
            run[0] = T.max(m_old, x)
            run[1] = T.if_then_else(
                T.Or(T.isnan(x), T.isnan(run[1])), x + run[1],
                T.if_then_else(run[0] == neg_inf, 0.0, run[1] * T.exp(m_old - run[0]) + T.exp(x - run[0])))

        @T.macro
        def lse_combine(run, lse_m, lse_s, tx, ties, thr, Lse, bx):
            # the block's logsumexp of the emitted scores, plus `ties` more scores equal to thr (threshold
            # ties, whichever program emits them), to Lse[bx]; -inf when nothing was selected
            m2 = T.alloc_var(f32)
            s2 = T.alloc_var(f32)
            mm = T.alloc_var(f32)
            for sh in T.unroll(5):
                m2 = T.shfl_down(run[0], 16 >> sh)
                s2 = T.shfl_down(run[1], 16 >> sh)
                mm = T.max(run[0], m2)
                # both maxima -inf: the sums are 0, or NaN (carried)
                run[1] = T.if_then_else(mm == neg_inf, run[1] + s2, run[1] * T.exp(run[0] - mm) + s2 * T.exp(m2 - mm))
                run[0] = mm
            if tx % 32 == 0:
                lse_m[tx // 32] = run[0]
                lse_s[tx // 32] = run[1]
            T.sync_threads()
            if tx == 0:
                mm = T.if_then_else(ties > 0, thr, neg_inf)
                for w in T.unroll(nwarps):
                    mm = T.max(mm, lse_m[w])
                s2 = T.if_then_else(ties > 0, T.cast(ties, f32) * T.exp(thr - mm), 0.0)
                for w in T.unroll(nwarps):
                    s2 = s2 + T.if_then_else(lse_m[w] == neg_inf, lse_s[w], lse_s[w] * T.exp(lse_m[w] - mm))
                Lse[bx] = T.if_then_else(mm == neg_inf, T.if_then_else(T.isnan(s2), s2, neg_inf), mm + T.log(s2))

        @T.prim_func
        def main(
            S: T.Tensor([R, n4, 4], T.float32),
            Starts: T.Tensor([R], T.int32),
            Ends: T.Tensor([R], T.int32),
            Offsets: T.Tensor([n_off], T.int32),
            offset_stride: T.int32,
            Out: T.Tensor([R, K], T.int32),
            Ties: T.Tensor([R, 2], T.int32),
            Lse: T.Tensor([R] if lse else [1], T.float32),
        ):
            with T.Kernel(R, threads=threads) as bx:
                tx = T.get_thread_binding()
                hist = T.alloc_shared([_NB1], i32)
                ckey = T.alloc_shared([cap], u32)
                cidx = T.alloc_shared([cap], i32)
                wsum = T.alloc_shared([32], i32)
                ctl = T.alloc_shared([8], i32)
                vals = T.alloc_local([unroll * 4], T.float32)
                if lse:
                    lse_m = T.alloc_shared([32], f32)
                    lse_s = T.alloc_shared([32], f32)
                    run = T.alloc_local([2], f32)  # running max, rescaled sum of exp
                    run[0] = neg_inf
                    run[1] = 0.0

                start = T.alloc_var(i32)
                end = T.alloc_var(i32)
                c0 = T.alloc_var(i32)
                c1 = T.alloc_var(i32)
                need = T.alloc_var(i32)
                b1 = T.alloc_var(u32)
                prefix = T.alloc_var(u32)
                use_cand = T.alloc_var(i32)
                ncand = T.alloc_var(i32)
                key = T.alloc_var(u32)
                col = T.alloc_var(i32)
                pos = T.alloc_var(i32)
                if agg:
                    lane = T.alloc_var(i32)
                    lt = T.alloc_var(u32)
                    m1 = T.alloc_var(u32)
                    m2 = T.alloc_var(u32)
                    bA = T.alloc_var(i32)
                    bB = T.alloc_var(i32)
                    f1 = T.alloc_var(i32)
                    f2 = T.alloc_var(i32)
                    n1 = T.alloc_var(i32)
                    n2 = T.alloc_var(i32)
                    lane = tx % 32
                    lt = (T.uint32(1) << T.cast(lane, u32)) - T.uint32(1)

                out_offset = T.alloc_var(i32)
                out_offset = Offsets[bx * offset_stride]  # added to every selected column of the row
                start = T.max(Starts[bx], 0)
                end = T.min(Ends[bx], n4 * 4)
                if tx == 0:
                    Ties[bx, 1] = 0  # no ties left for the tie-fill program (set below otherwise)
                if end - start <= K:
                    # Everything valid is selected; pad with -1.
                    for it in T.serial(T.ceildiv(K, threads)):
                        if it * threads + tx < K:
                            Out[bx, it * threads + tx] = T.if_then_else(
                                it * threads + tx < end - start, start + it * threads + tx + out_offset, -1
                            )
                            if lse and it * threads + tx < end - start:
                                col = start + it * threads + tx
                                lse_add(run, S[bx, col // 4, col % 4])
                    if lse:
                        lse_combine(run, lse_m, lse_s, tx, 0, 0.0, Lse, bx)
                else:
                    c0 = start // 4
                    c1 = (end + 3) // 4
                    for j in T.serial(_NB1 // threads):
                        hist[j * threads + tx] = 0
                    if tx < 8:
                        ctl[tx] = 0
                    T.sync_threads()

                    # ---- pass 1: 12-bit histogram ------------------------------------
                    for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                        load_chunk(S, bx, c0, c1, it, tx, vals)
                        for u in T.unroll(unroll):
                            for v in T.unroll(4):
                                col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                if col >= start and col < end:
                                    key = ordered(vals[u * 4 + v])
                                    T.atomic_add(hist[T.cast(key >> T.uint32(20), i32)], 1)
                    T.sync_threads()
                    find_threshold(hist, wsum, ctl, tx, bpt1, K)
                    b1 = T.cast(ctl[3], u32)
                    need = K - ctl[4]
                    use_cand = T.if_then_else(hist[ctl[3]] <= cap, 1, 0)
                    T.sync_threads()
                    for j in T.serial(_NB2 // threads):
                        hist[j * threads + tx] = 0

                    # ---- pass 2: emit digits above b1, gather digit == b1 -------------
                    for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                        load_chunk(S, bx, c0, c1, it, tx, vals)
                        for u in T.unroll(unroll):
                            for v in T.unroll(4):
                                col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                if agg:
                                    # one shared atomic per warp and output: slots from ballots
                                    key = ordered(vals[u * 4 + v])
                                    f1 = T.if_then_else(
                                        col >= start and col < end and (key >> T.uint32(20)) > b1, 1, 0)
                                    f2 = T.if_then_else(
                                        col >= start and col < end and (key >> T.uint32(20)) == b1 and use_cand == 1,
                                        1, 0)
                                    m1 = T.cast(T.ballot_sync(f1), u32)
                                    m2 = T.cast(T.ballot_sync(f2), u32)
                                    bA = 0
                                    bB = 0
                                    n1 = T.cast(T.popcount(m1), i32)
                                    n2 = T.cast(T.popcount(m2), i32)
                                    if lane == 0:
                                        if n1 > 0:
                                            bA = T.atomic_add(ctl[0], n1, return_prev=True)
                                        if n2 > 0:
                                            bB = T.atomic_add(ctl[1], n2, return_prev=True)
                                    bA = T.shfl_sync(bA, 0)
                                    bB = T.shfl_sync(bB, 0)
                                    if f1 == 1:
                                        Out[bx, bA + T.cast(T.popcount(m1 & lt), i32)] = col + out_offset
                                        if lse:
                                            lse_add(run, vals[u * 4 + v])
                                    if f2 == 1:
                                        ckey[bB + T.cast(T.popcount(m2 & lt), i32)] = key
                                        cidx[bB + T.cast(T.popcount(m2 & lt), i32)] = col
                                else:
                                    if col >= start and col < end:
                                        key = ordered(vals[u * 4 + v])
                                        if (key >> T.uint32(20)) > b1:
                                            pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                            Out[bx, pos] = col + out_offset
                                            if lse:
                                                lse_add(run, vals[u * 4 + v])
                                        elif (key >> T.uint32(20)) == b1 and use_cand == 1:
                                            pos = T.atomic_add(ctl[1], 1, return_prev=True)
                                            ckey[pos] = key
                                            cidx[pos] = col
                    T.sync_threads()
                    ncand = ctl[1]
                    prefix = b1

                    # ---- rounds 2 and 3: 10-bit digits over the candidates ------------
                    for r in T.unroll(2):
                        if use_cand == 1:
                            for it in T.serial(T.ceildiv(ncand, threads)):
                                if it * threads + tx < ncand:
                                    key = ckey[it * threads + tx]
                                    if (key >> T.uint32(20 - 10 * r)) == prefix:
                                        T.atomic_add(
                                            hist[T.cast((key >> T.uint32(10 - 10 * r)) & T.uint32(1023), i32)], 1
                                        )
                        else:
                            for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                                load_chunk(S, bx, c0, c1, it, tx, vals)
                                for u in T.unroll(unroll):
                                    for v in T.unroll(4):
                                        col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                        if col >= start and col < end:
                                            key = ordered(vals[u * 4 + v])
                                            if (key >> T.uint32(20 - 10 * r)) == prefix:
                                                T.atomic_add(
                                                    hist[T.cast((key >> T.uint32(10 - 10 * r)) & T.uint32(1023), i32)],
                                                    1,
                                                )
                        T.sync_threads()
                        find_threshold(hist, wsum, ctl, tx, bpt2, need)
                        prefix = (prefix << T.uint32(10)) | T.cast(ctl[3], u32)
                        need = need - ctl[4]
                        if tx == 0:  # after the last round: threshold-key columns beyond those still needed
                            ctl[5] = hist[ctl[3]] - need  # (in shared memory: a register costs occupancy)
                        T.sync_threads()
                        for j in T.serial(_NB2 // threads):
                            hist[j * threads + tx] = 0
                        T.sync_threads()

                    # ---- final pass: keys above the threshold; every tie when all are needed --------
                    # (at most `cap` candidates, or few emits per row: per-element slots)
                    if use_cand == 1:
                        for it in T.serial(T.ceildiv(ncand, threads)):
                            if it * threads + tx < ncand:
                                key = ckey[it * threads + tx]
                                if key > prefix or (key == prefix and ctl[5] == 0):
                                    pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                    Out[bx, pos] = cidx[it * threads + tx] + out_offset
                                    if lse and key > prefix:  # ties are counted once below
                                        lse_add(run, unordered(key))
                    else:
                        for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                            load_chunk(S, bx, c0, c1, it, tx, vals)
                            for u in T.unroll(unroll):
                                for v in T.unroll(4):
                                    col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                    if col >= start and col < end:
                                        key = ordered(vals[u * 4 + v])
                                        if (key >> T.uint32(20)) == b1 and (
                                            key > prefix or (key == prefix and ctl[5] == 0)
                                        ):
                                            pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                            Out[bx, pos] = col + out_offset
                                            if lse and key > prefix:
                                                lse_add(run, vals[u * 4 + v])
                    # ---- more ties than still needed: the tie-fill program takes the lowest columns
                    # (a separate program: its scan would cost this one registers and occupancy)
                    if ctl[5] > 0 and tx == 0:
                        Ties[bx, 0] = T.reinterpret(prefix, i32)
                        Ties[bx, 1] = need
                    if lse:  # `need` columns of the threshold key are selected, here or by the tie fill
                        lse_combine(run, lse_m, lse_s, tx, need, unordered(prefix), Lse, bx)

        return main

    @tilelang.jit(pass_configs=_pass_configs())
    def radix_tie_fill(threads: int = 256, unroll: int = 4):
        # Rows the select program left with ``need`` > 0 ties of key ``prefix`` (Ties[r] = (prefix,
        # need)): the ``need`` lowest such columns go to Out[r, K - need:]. Other rows return at once.
        R = T.dynamic("R")
        n4 = T.dynamic("n4")
        K = T.dynamic("K")
        n_off = T.dynamic("n_off")
        ordered, load_chunk, emit_ties_in_column_order = _row_macros(T, threads, unroll)

        @T.prim_func
        def fill(
            S: T.Tensor([R, n4, 4], T.float32),
            Starts: T.Tensor([R], T.int32),
            Ends: T.Tensor([R], T.int32),
            Ties: T.Tensor([R, 2], T.int32),
            Offsets: T.Tensor([n_off], T.int32),
            offset_stride: T.int32,
            Out: T.Tensor([R, K], T.int32),
        ):
            with T.Kernel(R, threads=threads) as bx:
                tx = T.get_thread_binding()
                wsum = T.alloc_shared([32], T.int32)
                ctl = T.alloc_shared([8], T.int32)
                vals = T.alloc_local([unroll * 4], T.float32)
                need = T.alloc_var(T.int32)
                start = T.alloc_var(T.int32)
                end = T.alloc_var(T.int32)
                need = Ties[bx, 1]
                if need > 0:  # uniform over the CTA
                    start = T.max(Starts[bx], 0)
                    end = T.min(Ends[bx], n4 * 4)
                    if tx < 8:
                        ctl[tx] = 0
                    T.sync_threads()
                    emit_ties_in_column_order(S, bx, start // 4, (end + 3) // 4, start, end,
                                              T.reinterpret(Ties[bx, 0], T.uint32), need, tx, vals, wsum, ctl,
                                              Offsets[bx * offset_stride], Out, K)

        return fill

    @tilelang.jit(pass_configs=_pass_configs())
    def radix_topk_split(threads: int = 1024, parts: int = 8, cap: int = 4096, unroll: int = 4):
        # One row per cluster of `parts` CTAs, each over a contiguous slice of the row's columns: the digit
        # histograms are summed through distributed shared memory (every CTA sums all of them, so each finds
        # the same digits), each CTA emits its own selected columns at output slots taken from a counter in
        # the shared memory of the cluster's CTA 0, and keeps its own candidates. Same sets as ``radix_topk``
        # (rows with more threshold ties than needed go to the tie-fill program the same way); no lse.
        assert threads % 32 == 0 and _NB2 % threads == 0 and parts in (2, 4, 8), (threads, parts)
        bpt1 = _NB1 // threads
        bpt2 = _NB2 // threads
        R = T.dynamic("R")
        n4 = T.dynamic("n4")
        K = T.dynamic("K")
        n_off = T.dynamic("n_off")
        u32 = T.uint32
        i32 = T.int32
        ordered, load_chunk, _ = _row_macros(T, threads, unroll)
        find_threshold = _threshold_macro(T, threads)

        def peer(buf, j, rank):
            return T.call_extern(i32, "dsa_peer_i32", T.address_of(buf[j]), rank)

        @T.macro
        def sum_peers(hist, tot, tx, bins, h0):
            # tot[b] = the sum over the cluster's CTAs of hist[h0 + b] (after a cluster barrier): each thread 4
            # consecutive bins, one 16-byte load per peer, all loads in flight before the sums
            for j in T.unroll(T.ceildiv(bins, threads * 4)):
                if (j * threads + tx) * 4 < bins:
                    T.call_extern("handle", f"dsa_cluster_sum4<{parts}>",
                                  T.address_of(hist[h0 + (j * threads + tx) * 4]),
                                  T.address_of(tot[(j * threads + tx) * 4]))
            T.sync_threads()

        @T.macro
        def emit(flag, col, ctl, lane, lt, slot, Out, row, out_offset):
            # the flagged lanes' columns to Out[row, slots from CTA 0's counter]: one remote atomic per warp
            # (slot: [2] local scratch, the ballot and the warp's first slot)
            slot[0] = T.cast(T.ballot_sync(flag), i32)
            if slot[0] != 0:  # the same in every lane of the warp
                slot[1] = 0
                if lane == 0:
                    slot[1] = T.call_extern(i32, "dsa_peer_add_i32", T.address_of(ctl[0]), 0,
                                            T.cast(T.popcount(T.cast(slot[0], u32)), i32))
                slot[1] = T.shfl_sync(slot[1], 0)
                if flag == 1:
                    Out[row, slot[1] + T.cast(T.popcount(T.cast(slot[0], u32) & lt), i32)] = col + out_offset

        @T.prim_func
        def split(
            S: T.Tensor([R, n4, 4], T.float32),
            Starts: T.Tensor([R], T.int32),
            Ends: T.Tensor([R], T.int32),
            Offsets: T.Tensor([n_off], T.int32),
            offset_stride: T.int32,
            Out: T.Tensor([R, K], T.int32),
            Ties: T.Tensor([R, 2], T.int32),
        ):
            with T.Kernel(R * parts, threads=threads, prelude=CLUSTER_PRELUDE + _SPLIT_PRELUDE,
                          cluster_dims=(parts, 1, 1)) as bx:
                tx = T.get_thread_binding()
                row = bx // parts
                rank = bx % parts
                hist = T.alloc_shared([_NB1], i32)
                hist2 = T.alloc_shared([2 * _NB2], i32)  # the two later digits' histograms, one each: no
                # peer reads a histogram that is being cleared, so no cluster barrier before a clear
                tot = T.alloc_shared([_NB1], i32)
                ckey = T.alloc_shared([cap], u32)
                cidx = T.alloc_shared([cap], i32)
                wsum = T.alloc_shared([32], i32)
                ctl = T.alloc_shared([8], i32)
                vals = T.alloc_local([unroll * 4], T.float32)
                start = T.alloc_var(i32)
                end = T.alloc_var(i32)
                c0 = T.alloc_var(i32)
                c1 = T.alloc_var(i32)
                p0 = T.alloc_var(i32)
                p1 = T.alloc_var(i32)
                lo = T.alloc_var(i32)
                hi = T.alloc_var(i32)
                need = T.alloc_var(i32)
                b1 = T.alloc_var(u32)
                prefix = T.alloc_var(u32)
                use_cand = T.alloc_var(i32)
                ncand = T.alloc_var(i32)
                key = T.alloc_var(u32)
                col = T.alloc_var(i32)
                flag = T.alloc_var(i32)
                slot = T.alloc_local([2], i32)
                m2 = T.alloc_var(u32)
                bB = T.alloc_var(i32)
                lane = T.alloc_var(i32)
                lt = T.alloc_var(u32)
                lane = tx % 32
                lt = (T.uint32(1) << T.cast(lane, u32)) - T.uint32(1)

                out_offset = T.alloc_var(i32)
                out_offset = Offsets[row * offset_stride]
                start = T.max(Starts[row], 0)
                end = T.min(Ends[row], n4 * 4)
                if rank == 0 and tx == 0:
                    Ties[row, 1] = 0
                if end - start <= K:  # uniform over the cluster: no cluster barrier on this path
                    if rank == 0:
                        for it in T.serial(T.ceildiv(K, threads)):
                            if it * threads + tx < K:
                                Out[row, it * threads + tx] = T.if_then_else(
                                    it * threads + tx < end - start, start + it * threads + tx + out_offset, -1)
                else:
                    c0 = start // 4
                    c1 = (end + 3) // 4
                    # this CTA's slice of the row, in float4 units
                    p0 = T.min(c0 + rank * T.ceildiv(c1 - c0, parts), c1)
                    p1 = T.min(p0 + T.ceildiv(c1 - c0, parts), c1)
                    lo = T.max(start, p0 * 4)  # the columns this CTA counts and emits
                    hi = T.min(end, p1 * 4)
                    for j in T.serial(bpt1):
                        hist[j * threads + tx] = 0
                    for j in T.serial(2 * bpt2):
                        hist2[j * threads + tx] = 0
                    if tx < 8:
                        ctl[tx] = 0
                    T.call_extern("handle", "dsa_cluster_sync")  # every counter is zero before any peer adds

                    # ---- pass 1: 12-bit histogram of the slice, summed over the cluster ----------
                    for it in T.serial(T.ceildiv(p1 - p0, threads * unroll)):
                        load_chunk(S, row, p0, p1, it, tx, vals)
                        for u in T.unroll(unroll):
                            for v in T.unroll(4):
                                col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                if col >= lo and col < hi:
                                    key = ordered(vals[u * 4 + v])
                                    T.atomic_add(hist[T.cast(key >> T.uint32(20), i32)], 1)
                    T.call_extern("handle", "dsa_cluster_sync")
                    sum_peers(hist, tot, tx, _NB1, 0)
                    find_threshold(tot, wsum, ctl, tx, bpt1, K)
                    b1 = T.cast(ctl[3], u32)
                    need = K - ctl[4]
                    if tx < parts:  # candidates in shared memory if every CTA's share of digit b1 fits
                        T.call_extern("handle", "atomicMax", T.address_of(ctl[6]), peer(hist, ctl[3], tx))
                    T.sync_threads()
                    use_cand = T.if_then_else(ctl[6] <= cap, 1, 0)

                    # ---- pass 2: emit digits above b1, gather digit == b1 --------------------
                    for it in T.serial(T.ceildiv(p1 - p0, threads * unroll)):
                        if T.ceildiv(p1 - p0, threads * unroll) > 1:  # else pass 1's values are still in vals
                            load_chunk(S, row, p0, p1, it, tx, vals)
                        for u in T.unroll(unroll):
                            for v in T.unroll(4):
                                col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                key = ordered(vals[u * 4 + v])
                                flag = T.if_then_else(col >= lo and col < hi and (key >> T.uint32(20)) > b1,
                                                      1, 0)
                                emit(flag, col, ctl, lane, lt, slot, Out, row, out_offset)
                                flag = T.if_then_else(
                                    col >= lo and col < hi and (key >> T.uint32(20)) == b1 and use_cand == 1, 1, 0)
                                m2 = T.cast(T.ballot_sync(flag), u32)
                                if m2 != T.uint32(0):  # the same in every lane of the warp
                                    bB = 0
                                    if lane == 0:
                                        bB = T.atomic_add(ctl[1], T.cast(T.popcount(m2), i32), return_prev=True)
                                    bB = T.shfl_sync(bB, 0)
                                    if flag == 1:
                                        ckey[bB + T.cast(T.popcount(m2 & lt), i32)] = key
                                        cidx[bB + T.cast(T.popcount(m2 & lt), i32)] = col
                    T.sync_threads()
                    ncand = ctl[1]
                    prefix = b1

                    # ---- rounds 2 and 3: 10-bit digits, histograms summed over the cluster -------
                    # (the same count as radix_topk's rounds, written out again: one macro for both programs took
                    # the 256-thread select from 56 to 63 registers and 1.3% slower, H100 A/B at 8192 x 8192)
                    for r in T.unroll(2):
                        if use_cand == 1:
                            for it in T.serial(T.ceildiv(ncand, threads)):
                                if it * threads + tx < ncand:
                                    key = ckey[it * threads + tx]
                                    if (key >> T.uint32(20 - 10 * r)) == prefix:
                                        T.atomic_add(
                                            hist2[r * _NB2 + T.cast((key >> T.uint32(10 - 10 * r)) & T.uint32(1023),
                                                                    i32)], 1)
                        else:
                            for it in T.serial(T.ceildiv(p1 - p0, threads * unroll)):
                                load_chunk(S, row, p0, p1, it, tx, vals)
                                for u in T.unroll(unroll):
                                    for v in T.unroll(4):
                                        col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                        if col >= lo and col < hi:
                                            key = ordered(vals[u * 4 + v])
                                            if (key >> T.uint32(20 - 10 * r)) == prefix:
                                                T.atomic_add(
                                                    hist2[r * _NB2 + T.cast((key >> T.uint32(10 - 10 * r))
                                                                            & T.uint32(1023), i32)], 1)
                        T.call_extern("handle", "dsa_cluster_sync")
                        sum_peers(hist2, tot, tx, _NB2, r * _NB2)
                        find_threshold(tot, wsum, ctl, tx, bpt2, need)
                        prefix = (prefix << T.uint32(10)) | T.cast(ctl[3], u32)
                        need = need - ctl[4]
                        if tx == 0:  # after the last round: threshold-key columns beyond those still needed
                            ctl[5] = tot[ctl[3]] - need
                        T.sync_threads()

                    # ---- final pass: keys above the threshold; every tie when all are needed --------
                    if use_cand == 1:
                        for it in T.serial(T.ceildiv(ncand, threads)):
                            key = ckey[T.min(it * threads + tx, cap - 1)]
                            flag = T.if_then_else(
                                it * threads + tx < ncand and (key > prefix or (key == prefix and ctl[5] == 0)), 1, 0)
                            emit(flag, cidx[T.min(it * threads + tx, cap - 1)], ctl, lane, lt, slot, Out, row,
                                 out_offset)
                    else:
                        for it in T.serial(T.ceildiv(p1 - p0, threads * unroll)):
                            load_chunk(S, row, p0, p1, it, tx, vals)
                            for u in T.unroll(unroll):
                                for v in T.unroll(4):
                                    col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                    key = ordered(vals[u * 4 + v])
                                    flag = T.if_then_else(
                                        col >= lo and col < hi and (key >> T.uint32(20)) == b1
                                        and (key > prefix or (key == prefix and ctl[5] == 0)), 1, 0)
                                    emit(flag, col, ctl, lane, lt, slot, Out, row, out_offset)
                    if ctl[5] > 0 and rank == 0 and tx == 0:
                        Ties[row, 0] = T.reinterpret(prefix, i32)
                        Ties[row, 1] = need
                    T.call_extern("handle", "dsa_cluster_sync")  # CTA 0's counter outlives every peer's adds

        return split

    return {"radix_topk": radix_topk, "radix_tie_fill": radix_tie_fill, "radix_topk_split": radix_topk_split}


def _config_key(config: dict) -> tuple:
    cfg = dict(DEFAULT_CONFIG)
    cfg.update(config or {})
    parts = int(cfg.get("parts", 0) or 0)
    if parts and (cfg.get("lse") or cfg.get("agg")):
        raise ValueError(f"the split top-k (parts={parts}) writes no lse and aggregates its slots itself, got {config}")
    if parts not in (0, 2, 4, 8):
        raise ValueError(f"parts must be 0 (one CTA per row), 2, 4 or 8, got {parts}")
    return (int(cfg["threads"]), int(cfg["cap"]), int(cfg["unroll"]), bool(cfg.get("agg", False)),
            bool(cfg.get("lse", False)), parts)


_BUILD_LOCK = threading.Lock()
_BUILT: dict = {}


#: the tie-fill program's CTA shape (one program serves every select configuration)
TIE_FILL_CONFIG = {"threads": 256, "unroll": 4}


def _build(name: str, key: tuple, params: dict, target):
    import tilelang

    tkey = repr(target)
    kern = _BUILT.get((name, key, tkey))
    if kern is None:
        announce_compile(name)
        with _BUILD_LOCK:  # TIR construction is not thread-safe; nvcc below runs in parallel
            tir = _factory()[name].get_tir(**params)
        kern = tilelang.compile(tir, target=target if target is not None else "auto", pass_configs=_pass_configs())
        logger.info("compiled TileLang %s %s target=%s", name, params, tkey)
        with _BUILD_LOCK:
            kern = _BUILT.setdefault((name, key, tkey), kern)
    return kern


def build_topk(config: dict | None = None, target=None):
    """Compile the radix top-k select program for ``config`` (a SHIPPED_CONFIGS entry) and
    ``target`` (default: the current CUDA device; ``{"kind": "cuda", "arch": "sm_90a"}`` compiles
    on CPU)."""
    threads, cap, unroll, agg, lse, parts = key = _config_key(config)
    if parts:
        return _build("radix_topk_split", key, dict(threads=threads, parts=parts, cap=cap, unroll=unroll), target)
    return _build("radix_topk", key, dict(threads=threads, cap=cap, unroll=unroll, agg=agg, lse=lse), target)


def build_tie_fill(target=None):
    """Compile the tie-fill program (rows with more ties at the threshold than still needed)."""
    params = dict(TIE_FILL_CONFIG)
    return _build("radix_tie_fill", tuple(params.values()), params, target)


def build_all(target=None) -> list:
    """Every shipped program: the select configurations and the tie-fill program."""
    return [build_topk(cfg, target=target) for cfg in SHIPPED_CONFIGS] + [build_tie_fill(target=target)]


def _check_cuda(name, t, dtype):
    import torch

    if not isinstance(t, torch.Tensor) or t.dtype != dtype or not t.is_cuda:
        got = f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dtype} CUDA tensor, got {got}")


def topk_rows_ranges(scores, starts, ends, topk: int, row_offsets=None, out=None, config=None, lse=None):
    """Top-k inside per-row column ranges [starts[r], ends[r]) of ``scores`` [R, N] fp32.

    Returns [R, topk] int32 = column + ``row_offsets[r]`` ([R] int32; None: 0) of the selected
    entries, -1 padding when a range holds fewer than ``topk`` columns. ``scores`` must be
    row-contiguous with N % 4 == 0 (the caller pads); ranges are clamped to [0, N), so columns outside
    them, or past the buffer, are never read. ``lse`` ([R] fp32, written): each row's logsumexp of the
    scores it selects (-inf for an empty range), computed while they are emitted.
    """
    import torch

    R, N = scores.shape
    assert N % 4 == 0 and scores.stride(1) == 1 and scores.stride(0) == N
    if out is None:
        out = torch.empty(R, topk, dtype=torch.int32, device=scores.device)
    if R == 0:
        return out
    if row_offsets is None:
        offsets, stride = zeros_arg(1, torch.int32, scores.device), 0  # one 0 read with stride 0
    else:
        assert row_offsets.dtype == torch.int32 and row_offsets.shape == (R,) and row_offsets.stride(0) == 1
        offsets, stride = row_offsets, 1
    ties = torch.empty(R, 2, dtype=torch.int32, device=scores.device)
    view = scores.view(R, N // 4, 4)
    cfg = dict(config if config is not None else config_for_rows(R, N, lse is not None))
    cfg["lse"] = lse is not None
    if cfg.get("parts"):
        if lse is not None:
            raise ValueError("the split top-k (parts) writes no lse: pick a one-CTA-per-row configuration")
        build_topk(cfg)(view, starts, ends, offsets, stride, out, ties)
    else:
        if lse is not None:
            assert lse.dtype == torch.float32 and lse.shape == (R,) and lse.stride(0) == 1
        build_topk(cfg)(view, starts, ends, offsets, stride, out, ties,
                        lse if lse is not None else unread_arg(1, torch.float32, scores.device))
    build_tie_fill()(view, starts, ends, ties, offsets, stride, out)
    return out


def topk_rows(scores, lengths, topk: int, *, config=None):
    """Exact top-k per row by radix select.

    scores [R, N] fp32 CUDA; lengths [R] int32 (valid columns 0..lengths[r]-1) or None (all N).
    Returns [R, topk] int32 column indices of the ``topk`` largest valid scores, -1 padding
    when lengths[r] < topk. Among equal scores the lowest column wins (-0.0 ties with +0.0); the
    order of the indices inside a row is unspecified (not sorted).
    """
    import torch

    _check_cuda("scores", scores, torch.float32)
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D [R, N], got shape {tuple(scores.shape)}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    R, N = scores.shape
    if lengths is None:
        ends = torch.full((R,), N, dtype=torch.int32, device=scores.device)
    else:
        _check_cuda("lengths", lengths, torch.int32)
        if lengths.shape != (R,):
            raise ValueError(f"lengths must have shape [{R}], got {tuple(lengths.shape)}")
        ends = lengths.clamp(0, N).contiguous()
    if N % 4 != 0 or not scores.is_contiguous() or scores.data_ptr() % 16:  # rows read as float4
        n4 = (N + 3) // 4 * 4
        padded = torch.empty(R, n4, dtype=torch.float32, device=scores.device)
        padded[:, :N] = scores
        scores = padded
    starts = torch.zeros(R, dtype=torch.int32, device=scores.device)
    return topk_rows_ranges(scores, starts, ends, topk, config=config)
