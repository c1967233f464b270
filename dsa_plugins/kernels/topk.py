"""Exact radix top-k over the rows of an fp32 score matrix (TileLang, Hopper).

One CTA per row (``radix_topk``), or for a few long rows one cluster of 4 or 8 CTAs per row
(``radix_topk_split``: each CTA takes a slice of the columns, the digit histograms are summed
through distributed shared memory). Scores are mapped to order-preserving uint32 keys and the
k-th largest key is found digit by digit (12 + 10 + 10 bits):

1. histogram of the top 12 bits over the row's valid columns (global memory);
2. a second read of the row emits every column whose top digit is above the threshold
   digit, and gathers the columns of the threshold digit into shared memory when they fit
   (``cap`` entries; otherwise the later rounds re-read the row from global memory);
3. two 10-bit rounds over that candidate set fix the exact 32-bit threshold key (the second is skipped when
   the first leaves exactly as many keys of its 22-bit prefix as are still needed: all of them are taken);
4. a last pass emits the candidates above the threshold, and every column of the threshold key
   when all of them are needed. The selected columns are marked in a bitmap of the row's range in
   shared memory and written from it in ascending column order (one block scan of per-thread counts);
5. a second program, ``radix_finish``, completes the rest: when more columns share the threshold
   key than are still needed, it re-reads the row in column order and ranks the ties with a
   block-wide prefix count (the lowest columns win) and writes the row in order again; rows too long
   for the select program's bitmap (emitted at slots taken from atomics) are ordered there too. It
   is a program of its own because its scans would cost the select program registers (48 -> 82 at
   256 threads) and occupancy; other rows leave it at once.

The result is exact and canonical (DSA.md 2): the same set as a stable sort by score, descending,
where among equal scores the lowest column wins and -0.0 ties with +0.0. A row's selection so
depends on its own scores only, never on how rows are packed, chunked or launched.
The CTA size is chosen from the row count and length (``config_for_rows``). H200: 64 rows
x 32768, k 2048: 0.028 ms (torch.topk 0.114 ms); H100 with the tie rule: 0.027 + 0.005 ms.
Rows whose valid range holds at most ``topk`` columns return all of them followed by -1.
Each row comes in ascending column order, -1 padding last: the sparse attention sums its slots in
index order, so this order is what makes its output bits the same alone, in a batch, and from run to run.
The same holds for the optional lse (the logsumexp of a row's selected scores, for the indexer loss): the
candidates' scores enter it from a bitmap in column order (a row past the bitmap: one window of it at a time).

TileLang is imported lazily so that this module imports without TileLang or a GPU.

Size: one file for the family (the select programs and the finish program share the key order,
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
    # 256-thread CTA: several rows share an SM (best for many rows of up to 32K columns). 5 CTAs per SM (48
    # registers, no spills) with 2 float4 loads per step: H200, a causal prefill's indexer scores, T 8K / 32K,
    # 1.10 / 1.11x faster than 4 CTAs of 4 loads (64 registers); 6 CTAs (40 registers, spilling) 1.10 / 1.10x with
    # 2 loads, 1.08 / 1.06x with 4; 4 CTAs of 2 loads 1.02 / 1.02x (bench_topk_configs.py --prefill)
    {"threads": 256, "cap": 2048, "unroll": 2, "agg": True, "min_blocks": 5},
    # 1024-thread CTA, per-element shared atomics (best when there are few rows)
    {"threads": 1024, "cap": 8192, "unroll": 4, "agg": False},
    # 512-thread CTA (best for many rows longer than 32K columns); 3 CTAs per SM (40 registers, a few spilled) with 2
    # float4 loads per step: H200, 1024 / 4096 x 65536 and 1024 x 131072: 1.13 / 1.19 / 1.16x 2 CTAs of 4 loads
    {"threads": 512, "cap": 4096, "unroll": 2, "agg": True, "min_blocks": 3},
]
#: each also with ``lse``: it writes every row's logsumexp of the scores it selects (the indexer KL loss
#: takes it instead of recomputing the logits); ties at the threshold enter by count, so the finish
#: program needs no change. Each thread adds the scores of its own columns, in column order, and the threads'
#: sums are combined in a fixed tree: the same bits from run to run (never the order of the shared atomics)
SHIPPED_CONFIGS += [{**cfg, "lse": True} for cfg in SHIPPED_CONFIGS]
#: the split program (``parts`` CTAs per row, one cluster; no lse): few long rows, the generation steps.
#: H100, indexer-like scores, k 2048, select + finish from a CUDA graph (one CTA per row -> split):
#: 1 x 131072 59.9 -> 29.9 us, 8 x 131072 56.5 -> 29.4, 16 x 131072 62.9 -> 37.8 (4 parts), 1 / 8 x 32768
#: 25.6 / 26.9 -> 22.8 / 23.1 (4 parts; 8 parts 26.8 / 27.2): both programs are a chain of latency-bound phases
#: of 20-25 us per row; past 16 rows the clusters no longer fit in one wave (32 x 32768: 25.6 -> 41.8)
SPLIT_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 8}
SPLIT4_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 4}
#: two CTAs per row still fit one wave up to 64 rows. H200, indexer-like scores, k 2048, one CTA per row -> two
#: parts: 32 x 65536 35.6 -> 31.1 us, 32 x 131072 55.6 -> 42.7, 64 x 131072 56.6 -> 43.9 (four parts of 512 or
#: 1024 threads lose past 16 rows: 32 x 131072 65.1 / 55.0; bench_topk_configs.py, logs/h200_topk_split2_*.log);
#: rows of 32K too: 16 / 32 / 48 / 64 x 32768 25.8 / 25.7 / 25.9 / 25.8 -> 22.4 / 23.1 / 22.9 / 23.2
#: (logs/h200_topk_split2_32k_d2bb8f6.log; a generation step of B 16-64 over 32K caches); and 1-8 rows of exactly
#: 32768, whose halves are one load per thread (pass 2 reuses pass 1's values): 1 / 8 x 32768 21.8 / 21.6 -> 21.0 /
#: 20.7 us against four parts (logs/h200_topk_gather_pdl.log)
SPLIT2_CONFIG = {"threads": 1024, "cap": 4096, "unroll": 4, "parts": 2}
SHIPPED_CONFIGS += [SPLIT_CONFIG, SPLIT4_CONFIG, SPLIT2_CONFIG]

DEFAULT_CONFIG = SHIPPED_CONFIGS[2]
MANY_SHORT_ROWS_CONFIG = SHIPPED_CONFIGS[1]
MANY_LONG_ROWS_CONFIG = SHIPPED_CONFIGS[3]
#: with fewer rows than this one big CTA per row is best (rows < SMs); measured on H200
FEW_ROWS = 264
#: the split program's rows: up to SPLIT8_MAX_ROWS rows of at least SPLIT8_MIN_COLS columns take 8 parts; 4 parts
#: take up to SPLIT8_MAX_ROWS rows of more than SPLIT_MIN_COLS and up to SPLIT_MAX_ROWS of at least SPLIT8_MIN_COLS;
#: 2 parts up to SPLIT2_MAX_ROWS rows of at least SPLIT_MIN_COLS (so 1-8 rows of exactly SPLIT_MIN_COLS take 2)
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
        if (rows <= SPLIT8_MAX_ROWS and max_cols > SPLIT_MIN_COLS) or max_cols >= SPLIT8_MIN_COLS:
            return SPLIT4_CONFIG
    if not lse and rows <= SPLIT2_MAX_ROWS and max_cols >= SPLIT_MIN_COLS:
        return SPLIT2_CONFIG
    if rows < FEW_ROWS:
        return DEFAULT_CONFIG
    return MANY_SHORT_ROWS_CONFIG if max_cols <= SHORT_ROW_MAX else MANY_LONG_ROWS_CONFIG


#: the finish program orders rows of up to SORT_MAX_K selected columns in shared memory (32 KB), marking
#: SORT_WINDOW_BITS columns at a time in a bitmap (8 KB); larger k is ordered by the caller (torch.sort)
SORT_MAX_K = 8192
SORT_WINDOW_BITS = 65536
#: the select programs write a row in ascending column order themselves when its range (radix_topk) or a CTA's
#: slice of it (split) fits a bitmap of this many words (32 columns a word) in shared memory; the finish program
#: orders longer rows
ORDER_WORDS = {256: 1024, 512: 2048, 1024: 4096}
SPLIT_ORDER_WORDS = 2048

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


def _order_macros(T, threads: int):
    """The pieces that write a row's selection in ascending column order from a bitmap in shared memory
    (bit b of word w: column first + 32 w + b), shared by the select programs and the finish program, and the
    warp scan under the block scan (also the split program's candidate slots).
    ``sc`` is a local int32 scratch of 3: [0] this thread's count, [1] its inclusive block prefix, [2] a slot;
    ``wv`` a local uint32 scratch of 1."""
    nwarps = threads // 32
    u32 = T.uint32
    i32 = T.int32

    @T.macro
    def mark_nibble(bits, nib, idx4, nwords, tx, wv, accumulate: bool = False):
        # the flags of the 4 consecutive columns of float4 `idx4` (bits 0-3 of nib; idx4 counted from the bitmap's
        # first column, so the 8 lanes tx // 8 * 8 ... + 7 hold one word) into word idx4 // 8: the 8 lanes OR their
        # nibbles and the first of them stores it (``accumulate``: ORs it into the word). One writer per word, and
        # pass 2 stores every word of the range, so the bitmap needs no clearing. Every lane of the warp must call
        # it.
        wv[0] = T.cast(nib, u32) << T.cast((tx % 8) * 4, u32)
        wv[0] = wv[0] | T.shfl_xor(wv[0], 1)
        wv[0] = wv[0] | T.shfl_xor(wv[0], 2)
        wv[0] = wv[0] | T.shfl_xor(wv[0], 4)
        if tx % 8 == 0 and idx4 // 8 < nwords:
            if accumulate:
                bits[idx4 // 8] = bits[idx4 // 8] | wv[0]
            else:
                bits[idx4 // 8] = wv[0]

    @T.macro
    def warp_scan(sc, lane):
        # sc[1] <- the inclusive prefix of sc[0] over the lanes of the warp (sc[2]: scratch); every lane calls it
        sc[1] = sc[0]
        for s_ in T.unroll(5):
            sc[2] = T.shfl_up(sc[1], 1 << s_)
            if lane >= (1 << s_):
                sc[1] = sc[1] + sc[2]

    @T.macro
    def count_and_scan(bits, nwords, tx, wsum, sc):
        # sc[0] <- the set bits of this thread's words [tx * wpt, (tx + 1) * wpt), sc[1] <- their inclusive prefix
        # over the block; wsum[w] <- warp w's total. Has a barrier.
        sc[0] = 0
        for j in T.serial(T.ceildiv(nwords, threads)):
            if tx * T.ceildiv(nwords, threads) + j < nwords:
                sc[0] = sc[0] + T.cast(T.popcount(bits[tx * T.ceildiv(nwords, threads) + j]), i32)
        warp_scan(sc, tx % 32)
        if tx % 32 == 31:
            wsum[tx // 32] = sc[1]
        T.sync_threads()
        for w in T.unroll(nwarps):
            if w < tx // 32:
                sc[1] = sc[1] + wsum[w]

    @T.macro
    def write_in_order(bits, nwords, tx, sc, first, Out, row, wv):
        # this thread's set bits, in column order, to Out[row, sc[2]...] (sc[2]: its first slot)
        for j in T.serial(T.ceildiv(nwords, threads)):
            if tx * T.ceildiv(nwords, threads) + j < nwords:
                wv[0] = bits[tx * T.ceildiv(nwords, threads) + j]
                for _ in T.serial(T.cast(T.popcount(bits[tx * T.ceildiv(nwords, threads) + j]), i32)):
                    Out[row, sc[2]] = first + (tx * T.ceildiv(nwords, threads) + j) * 32 + (
                        T.__ffs(T.reinterpret(wv[0], i32)) - 1)
                    sc[2] = sc[2] + 1
                    wv[0] = wv[0] & (wv[0] - T.uint32(1))

    @T.macro
    def block_total(wsum, tot):
        # tot[0] <- the block's total (after count_and_scan)
        tot[0] = 0
        for w in T.unroll(nwarps):
            tot[0] = tot[0] + wsum[w]

    return mark_nibble, count_and_scan, write_in_order, block_total, warp_scan


# an OR into a word of the shared bitmap by its 32-bit shared address (red.shared, no returned value). TileLang
# 0.1.15's T.atomic_or emits red.global, which faults on a shared address (CUDA_ERROR_INVALID_ADDRESS_SPACE).
_ORDER_PRELUDE = r"""
__device__ __forceinline__ void dsa_shared_or(unsigned* word, unsigned bits) {
  asm volatile("red.shared.or.b32 [%0], %1;" :: "r"((unsigned)__cvta_generic_to_shared(word)), "r"(bits) : "memory");
}
"""


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
    def radix_topk(threads: int = 1024, cap: int = 8192, unroll: int = 4, agg: bool = False, lse: bool = False,
                   min_blocks: int = 0):
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
        mark_nibble, count_and_scan, write_in_order, _, _ = _order_macros(T, threads)
        owords = ORDER_WORDS[threads]
        # CTAs per SM that the register cap is set for (ptxas then keeps to 65536 / (threads * blocks))
        blocks_per_sm = min_blocks if min_blocks > 0 else max(1, 65536 // (threads * 64))

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
        def lse_walk(S, bx, run, cbits, wv, tx, per_thread, col0, nwords_left):
            # the scores of the columns marked in this thread's `per_thread` words of cbits (words tx * per_thread
            # + j, those below nwords_left; bit b of word w is column col0 + 32 w + b) enter run in column order
            for j in T.serial(per_thread):
                if tx * per_thread + j < nwords_left:
                    wv[0] = cbits[tx * per_thread + j]
                    # (the trip count from the shared word: a bound on wv, which the loop clears bit by bit, would
                    # be evaluated again at every step)
                    for _ in T.serial(T.cast(T.popcount(cbits[tx * per_thread + j]), i32)):
                        col = col0 + (tx * per_thread + j) * 32 + (T.__ffs(T.reinterpret(wv[0], i32)) - 1)
                        lse_add(run, S[bx, col // 4, col % 4])
                        wv[0] = wv[0] & (wv[0] - T.uint32(1))

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
            with T.Kernel(R, threads=threads, prelude=_ORDER_PRELUDE) as bx:
                # registers capped for `blocks_per_sm` CTAs per SM (by default 64 a thread: uncapped, the 256-thread
                # program took 71 with the ordering bitmap, one CTA per SM fewer than without it)
                T.annotate_min_blocks_per_sm(blocks_per_sm)
                tx = T.get_thread_binding()
                hist = T.alloc_shared([_NB1], i32)
                ckey = T.alloc_shared([cap], u32)
                cidx = T.alloc_shared([cap], i32)
                wsum = T.alloc_shared([32], i32)
                ctl = T.alloc_shared([8], i32)
                bits = T.alloc_shared([owords], u32)  # the selected columns, c0 * 4 + 32 w + b (use_bits)
                if lse:
                    # the columns the last pass selects from the candidates (their order there depends on the
                    # atomics that gathered them): their scores enter the lse from this bitmap, in column order
                    cbits = T.alloc_shared([owords], u32)
                sc = T.alloc_local([3], i32)
                wv = T.alloc_local([1], u32)
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
                use_bits = T.alloc_var(i32)
                nwords = T.alloc_var(i32)
                nib = T.alloc_var(i32)
                sel = T.alloc_var(i32)
                kshift = T.alloc_var(u32)
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
                    Ties[bx, 1] = 0  # no ties left for the finish program (set below otherwise)
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
                    # the selection in ascending column order straight from a bitmap of the range when it fits
                    # (else the finish program orders the row)
                    nwords = T.ceildiv(c1 - c0, 8)
                    use_bits = T.if_then_else(nwords <= owords, 1, 0)
                    for j in T.serial(_NB1 // threads):
                        hist[j * threads + tx] = 0
                    if lse:
                        for j in T.serial(owords // threads):
                            cbits[j * threads + tx] = T.uint32(0)
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

                    # ---- pass 2: emit digits above b1 (bits, or slots), gather digit == b1 -----
                    for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                        load_chunk(S, bx, c0, c1, it, tx, vals)
                        for u in T.unroll(unroll):
                            nib = 0
                            for v in T.unroll(4):
                                col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                if agg:
                                    # one shared atomic per warp and output: slots from ballots
                                    key = ordered(vals[u * 4 + v])
                                    sel = T.if_then_else(
                                        col >= start and col < end and (key >> T.uint32(20)) > b1, 1, 0)
                                    f1 = sel * (1 - use_bits)
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
                                    if f2 == 1:
                                        ckey[bB + T.cast(T.popcount(m2 & lt), i32)] = key
                                        cidx[bB + T.cast(T.popcount(m2 & lt), i32)] = col
                                else:
                                    sel = 0
                                    if col >= start and col < end:
                                        key = ordered(vals[u * 4 + v])
                                        if (key >> T.uint32(20)) > b1:
                                            sel = 1
                                            if use_bits == 0:
                                                pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                                Out[bx, pos] = col + out_offset
                                        elif (key >> T.uint32(20)) == b1 and use_cand == 1:
                                            pos = T.atomic_add(ctl[1], 1, return_prev=True)
                                            ckey[pos] = key
                                            cidx[pos] = col
                                if lse:
                                    if sel == 1:
                                        lse_add(run, vals[u * 4 + v])
                                nib = nib | (sel << v)
                            if use_bits == 1:  # uniform over the CTA
                                mark_nibble(bits, nib, (it * unroll + u) * threads + tx, nwords, tx, wv)
                    T.sync_threads()
                    ncand = ctl[1]
                    prefix = b1

                    # ---- rounds 2 and 3: 10-bit digits over the candidates ------------
                    # (kshift 10: round 2 left exactly `need` keys of its 22-bit prefix, so every one of them is
                    # selected and round 3 is skipped: the same set; not with lse, whose ties are counted at a key)
                    kshift = 0
                    for r in T.unroll(2):
                      if r == 0 or kshift == 0:
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
                        if not lse:
                            if r == 0 and ctl[5] == 0:
                                kshift = 10
                        T.sync_threads()

                    # ---- final pass: keys above the threshold; every tie when all are needed --------
                    # (at most `cap` candidates, or few emits per row: per-element slots). With lse, the scores of
                    # the candidates selected enter it from a bitmap in column order (below), never in the order
                    # the candidates were gathered in
                    if use_cand == 1:
                        for it in T.serial(T.ceildiv(ncand, threads)):
                            if it * threads + tx < ncand:
                                key = ckey[it * threads + tx]
                                if (key >> kshift) > prefix or ((key >> kshift) == prefix and ctl[5] == 0):
                                    col = cidx[it * threads + tx]
                                    if use_bits == 1:  # a bit of the bitmap, or a slot from the shared counter
                                        T.call_extern("handle", "dsa_shared_or",
                                                      T.address_of(bits[(col - c0 * 4) >> 5]),
                                                      T.uint32(1) << T.cast((col - c0 * 4) & 31, u32))
                                    else:
                                        pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                        Out[bx, pos] = col + out_offset
                                    if lse and key > prefix and use_bits == 1:  # ties are counted once below
                                        T.call_extern("handle", "dsa_shared_or",
                                                      T.address_of(cbits[(col - c0 * 4) >> 5]),
                                                      T.uint32(1) << T.cast((col - c0 * 4) & 31, u32))
                    else:
                        for it in T.serial(T.ceildiv(c1 - c0, threads * unroll)):
                            load_chunk(S, bx, c0, c1, it, tx, vals)
                            for u in T.unroll(unroll):
                                nib = 0
                                for v in T.unroll(4):
                                    col = (c0 + (it * unroll + u) * threads + tx) * 4 + v
                                    sel = 0
                                    if col >= start and col < end:
                                        key = ordered(vals[u * 4 + v])
                                        if (key >> T.uint32(20)) == b1 and (
                                            (key >> kshift) > prefix or ((key >> kshift) == prefix and ctl[5] == 0)
                                        ):
                                            sel = 1
                                            if use_bits == 0:
                                                pos = T.atomic_add(ctl[0], 1, return_prev=True)
                                                Out[bx, pos] = col + out_offset
                                            if lse and key > prefix:
                                                lse_add(run, vals[u * 4 + v])
                                    nib = nib | (sel << v)
                                # (nibbles, not a shared OR per column: per-column addresses took the 256-thread
                                # program from 64 to 80 registers)
                                if use_bits == 1:
                                    mark_nibble(bits, nib, (it * unroll + u) * threads + tx, nwords, tx, wv, True)
                    if lse and use_cand == 1 and use_bits == 0:
                        # a row longer than the bitmaps: its selected candidates enter the lse a window of owords
                        # words at a time, each window marked in cbits and walked in column order (as below); a
                        # re-read of the row took the 512-thread program at T 128K from 34.0 to 54.6 ms (H200)
                        for win in T.serial(T.ceildiv(nwords, owords)):
                            T.sync_threads()  # the last window's walk is done
                            for j in T.serial(owords // threads):
                                cbits[j * threads + tx] = T.uint32(0)
                            T.sync_threads()
                            for it in T.serial(T.ceildiv(ncand, threads)):
                                if it * threads + tx < ncand:
                                    key = ckey[it * threads + tx]
                                    col = cidx[it * threads + tx] - c0 * 4 - win * owords * 32
                                    if key > prefix and col >= 0 and col < owords * 32:
                                        T.call_extern("handle", "dsa_shared_or", T.address_of(cbits[col >> 5]),
                                                      T.uint32(1) << T.cast(col & 31, u32))
                            T.sync_threads()
                            lse_walk(S, bx, run, cbits, wv, tx, owords // threads, c0 * 4 + win * owords * 32, owords)
                    # ---- the bitmap's columns to slots [0, K - ties left) in ascending order
                    if use_bits == 1:
                        T.sync_threads()
                        if lse:  # the last pass's selections, each thread its own words in column order
                            lse_walk(S, bx, run, cbits, wv, tx, T.ceildiv(nwords, threads), c0 * 4, nwords)
                        count_and_scan(bits, nwords, tx, wsum, sc)
                        sc[2] = sc[1] - sc[0]
                        write_in_order(bits, nwords, tx, sc, c0 * 4 + out_offset, Out, bx, wv)
                    # ---- more ties than still needed: the finish program takes the lowest columns
                    # (a separate program: its scan would cost this one registers and occupancy) and writes the
                    # row in order again; a row too long for the bitmap is ordered there too (-1)
                    if ctl[5] > 0 and tx == 0:
                        Ties[bx, 0] = T.reinterpret(prefix, i32)
                        Ties[bx, 1] = need
                    elif use_bits == 0 and tx == 0:
                        Ties[bx, 1] = -1
                    if lse:  # `need` columns of the threshold key are selected, here or by the tie fill
                        lse_combine(run, lse_m, lse_s, tx, need, unordered(prefix), Lse, bx)

        return main

    @tilelang.jit(pass_configs=_pass_configs())
    def radix_finish(threads: int = 256, unroll: int = 4):
        # After a select program, one CTA per row:
        # 1. rows left with ``need`` > 0 ties of key ``prefix`` (Ties[r] = (prefix, need)): the ``need`` lowest such
        #    columns go to Out[r, K - need:];
        # 2. the rows the select program could not write in ascending column order (Ties[r, 1] != 0:
        #    the ties just filled, or -1: a range longer than the select program's bitmap, whose columns it emitted
        #    at slots taken from atomics) are rewritten in that order. The attention sums its slots in index order,
        #    so only a canonical order gives the same bits alone and in a batch. The K entries are kept in shared
        #    memory; windows of SORT_WINDOW_BITS columns are marked in a bitmap and compacted (one block scan of the
        #    per-thread counts per window). K > SORT_MAX_K is left to the caller.
        R = T.dynamic("R")
        n4 = T.dynamic("n4")
        K = T.dynamic("K")
        n_off = T.dynamic("n_off")
        i32 = T.int32
        u32 = T.uint32
        words = SORT_WINDOW_BITS // 32
        ordered, load_chunk, emit_ties_in_column_order = _row_macros(T, threads, unroll)
        _, count_and_scan, write_in_order, block_total, _ = _order_macros(T, threads)

        @T.prim_func
        def finish(
            S: T.Tensor([R, n4, 4], T.float32),
            Starts: T.Tensor([R], T.int32),
            Ends: T.Tensor([R], T.int32),
            Ties: T.Tensor([R, 2], T.int32),
            Offsets: T.Tensor([n_off], T.int32),
            offset_stride: T.int32,
            Out: T.Tensor([R, K], T.int32),
        ):
            with T.Kernel(R, threads=threads, prelude=_ORDER_PRELUDE) as bx:
                tx = T.get_thread_binding()
                wsum = T.alloc_shared([32], i32)
                ctl = T.alloc_shared([8], i32)
                vals = T.alloc_local([unroll * 4], T.float32)
                need = T.alloc_var(i32)
                start = T.alloc_var(i32)
                end = T.alloc_var(i32)
                need = Ties[bx, 1]
                start = T.max(Starts[bx], 0)
                end = T.min(Ends[bx], n4 * 4)
                if need > 0:  # uniform over the CTA
                    if tx < 8:
                        ctl[tx] = 0
                    T.sync_threads()
                    emit_ties_in_column_order(S, bx, start // 4, (end + 3) // 4, start, end,
                                              T.reinterpret(Ties[bx, 0], T.uint32), need, tx, vals, wsum, ctl,
                                              Offsets[bx * offset_stride], Out, K)
                stash = T.alloc_shared([SORT_MAX_K], i32)
                bitmap = T.alloc_shared([words], u32)
                sc = T.alloc_local([3], i32)
                wv = T.alloc_local([1], u32)
                tot = T.alloc_local([1], i32)
                lo = T.alloc_var(i32)
                nbits = T.alloc_var(i32)
                d = T.alloc_var(i32)
                # rows the select program left unordered (Ties[r, 1] != 0: ties filled above, or -1: a range
                # longer than its bitmap) that hold K distinct columns (uniform over the CTA)
                if need != 0 and end - start > K and K <= SORT_MAX_K:
                    T.sync_threads()  # the tie fill's stores are seen by the whole CTA
                    for j in T.serial(T.ceildiv(K, threads)):
                        if j * threads + tx < K:
                            stash[j * threads + tx] = Out[bx, j * threads + tx]
                    if tx == 0:
                        ctl[6] = 0  # entries written back so far
                    for w in T.serial(T.ceildiv(end - start, SORT_WINDOW_BITS)):
                        lo = start + Offsets[bx * offset_stride] + w * SORT_WINDOW_BITS
                        nbits = T.min(SORT_WINDOW_BITS, end - start - w * SORT_WINDOW_BITS)
                        for j in T.serial(T.ceildiv(T.ceildiv(nbits, 32), threads)):
                            if j * threads + tx < T.ceildiv(nbits, 32):
                                bitmap[j * threads + tx] = T.uint32(0)
                        T.sync_threads()
                        for j in T.serial(T.ceildiv(K, threads)):
                            if j * threads + tx < K:
                                d = stash[j * threads + tx] - lo
                                if d >= 0 and d < nbits:
                                    T.call_extern("handle", "dsa_shared_or", T.address_of(bitmap[d >> 5]),
                                                  T.uint32(1) << T.cast(d & 31, u32))
                        T.sync_threads()
                        count_and_scan(bitmap, T.ceildiv(nbits, 32), tx, wsum, sc)
                        sc[2] = ctl[6] + sc[1] - sc[0]
                        write_in_order(bitmap, T.ceildiv(nbits, 32), tx, sc, lo, Out, bx, wv)
                        block_total(wsum, tot)
                        T.sync_threads()
                        if tx == 0:
                            ctl[6] = ctl[6] + tot[0]
                        T.sync_threads()

        return finish

    @tilelang.jit(pass_configs=_pass_configs())
    def radix_topk_split(threads: int = 1024, parts: int = 8, cap: int = 4096, unroll: int = 4):
        # One row per cluster of `parts` CTAs, each over a contiguous slice of the row's columns: the digit
        # histograms are summed through distributed shared memory (every CTA sums all of them, so each finds
        # the same digits), each CTA emits its own selected columns at output slots taken from a counter in
        # the shared memory of the cluster's CTA 0, and keeps its own candidates. Same sets as ``radix_topk``
        # (rows with more threshold ties than needed go to the finish program the same way); no lse.
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
        mark_nibble, count_and_scan, write_in_order, block_total, warp_scan = _order_macros(T, threads)

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

        @T.macro
        def emit_final(flag, col, use_bits, bits, p0, ctl, lane, lt, slot, Out, row, out_offset):
            # a selected column of the final pass: a bit of the slice's bitmap, or a slot from CTA 0's counter
            if use_bits == 1:  # uniform over the cluster
                if flag == 1:
                    T.call_extern("handle", "dsa_shared_or", T.address_of(bits[(col - p0 * 4) >> 5]),
                                  T.uint32(1) << T.cast((col - p0 * 4) & 31, u32))
            else:
                emit(flag, col, ctl, lane, lt, slot, Out, row, out_offset)

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
            with T.Kernel(R * parts, threads=threads, prelude=CLUSTER_PRELUDE + _SPLIT_PRELUDE + _ORDER_PRELUDE,
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
                bits = T.alloc_shared([SPLIT_ORDER_WORDS], u32)  # this CTA's selected columns, p0 * 4 + 32 w + b
                sc = T.alloc_local([3], i32)
                wv = T.alloc_local([1], u32)
                btot = T.alloc_local([1], i32)
                use_bits = T.alloc_var(i32)
                nwords = T.alloc_var(i32)
                nib = T.alloc_var(i32)
                bB = T.alloc_var(i32)
                kshift = T.alloc_var(u32)
                lane = T.alloc_var(i32)
                lt = T.alloc_var(u32)
                lane = tx % 32
                lt = (T.uint32(1) << T.cast(lane, u32)) - T.uint32(1)
                T.call_extern("handle", "dsa_grid_dependency_wait")  # before the first global read (cluster.py)

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
                    # each CTA's selection in ascending column order from a bitmap of its slice, placed after the
                    # lower ranks' (uniform over the cluster; else the finish program orders the row)
                    nwords = T.ceildiv(p1 - p0, 8)
                    use_bits = T.if_then_else(T.ceildiv(T.ceildiv(c1 - c0, parts), 8) <= SPLIT_ORDER_WORDS, 1, 0)
                    for j in T.serial(bpt1):
                        hist[j * threads + tx] = 0
                    for j in T.serial(2 * bpt2):
                        hist2[j * threads + tx] = 0
                    if tx < 8:
                        ctl[tx] = 0
                    # (a block barrier: no peer reads or adds to this CTA's shared memory before the cluster barrier
                    # after pass 1, which also makes sure that every CTA of the cluster has started)
                    T.sync_threads()

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
                            nib = 0
                            # the candidates of this float4 over the warp: a scan of the lanes' counts and one
                            # shared atomic per warp (bB: this lane's first slot; a ballot and an atomic per
                            # column took 1-4% longer, H200, 1-64 rows of 32K-128K)
                            sc[0] = 0
                            for v in T.unroll(4):
                                col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                key = ordered(vals[u * 4 + v])
                                sc[0] = sc[0] + T.if_then_else(
                                    col >= lo and col < hi and (key >> T.uint32(20)) == b1 and use_cand == 1, 1, 0)
                            warp_scan(sc, lane)
                            bB = 0
                            if lane == 31 and sc[1] > 0:
                                bB = T.atomic_add(ctl[1], sc[1], return_prev=True)
                            bB = T.shfl_sync(bB, 31) + sc[1] - sc[0]
                            for v in T.unroll(4):
                                col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                key = ordered(vals[u * 4 + v])
                                flag = T.if_then_else(col >= lo and col < hi and (key >> T.uint32(20)) > b1,
                                                      1, 0)
                                if use_bits == 0:  # uniform over the cluster
                                    emit(flag, col, ctl, lane, lt, slot, Out, row, out_offset)
                                nib = nib | (flag << v)
                                flag = T.if_then_else(
                                    col >= lo and col < hi and (key >> T.uint32(20)) == b1 and use_cand == 1, 1, 0)
                                if flag == 1:
                                    ckey[bB] = key
                                    cidx[bB] = col
                                    bB = bB + 1
                            if use_bits == 1:
                                mark_nibble(bits, nib, (it * unroll + u) * threads + tx, nwords, tx, wv)
                    T.sync_threads()
                    ncand = ctl[1]
                    prefix = b1

                    # ---- rounds 2 and 3: 10-bit digits, histograms summed over the cluster -------
                    # (the same count as radix_topk's rounds, written out again: one macro for both programs took
                    # the 256-thread select from 56 to 63 registers and 1.3% slower, H100 A/B at 8192 x 8192;
                    # kshift 10: round 3 skipped as there, uniform over the cluster)
                    kshift = 0
                    for r in T.unroll(2):
                      if r == 0 or kshift == 0:
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
                        if r == 0 and ctl[5] == 0:
                            kshift = 10

                    # ---- final pass: keys above the threshold; every tie when all are needed --------
                    if use_cand == 1:
                        for it in T.serial(T.ceildiv(ncand, threads)):
                            key = ckey[T.min(it * threads + tx, cap - 1)]
                            flag = T.if_then_else(
                                it * threads + tx < ncand
                                and ((key >> kshift) > prefix or ((key >> kshift) == prefix and ctl[5] == 0)), 1, 0)
                            emit_final(flag, cidx[T.min(it * threads + tx, cap - 1)], use_bits, bits, p0, ctl, lane,
                                       lt, slot, Out, row, out_offset)
                    else:
                        for it in T.serial(T.ceildiv(p1 - p0, threads * unroll)):
                            load_chunk(S, row, p0, p1, it, tx, vals)
                            for u in T.unroll(unroll):
                                for v in T.unroll(4):
                                    col = (p0 + (it * unroll + u) * threads + tx) * 4 + v
                                    key = ordered(vals[u * 4 + v])
                                    flag = T.if_then_else(
                                        col >= lo and col < hi and (key >> T.uint32(20)) == b1
                                        and ((key >> kshift) > prefix or ((key >> kshift) == prefix and ctl[5] == 0)),
                                        1, 0)
                                    emit_final(flag, col, use_bits, bits, p0, ctl, lane, lt, slot, Out, row,
                                               out_offset)
                    # ---- each CTA's bits to its slots, after the lower ranks' (ctl[7]: this CTA's count)
                    if use_bits == 1:
                        T.sync_threads()
                        count_and_scan(bits, nwords, tx, wsum, sc)
                        block_total(wsum, btot)
                        if tx == 0:
                            ctl[7] = btot[0]
                        T.call_extern("handle", "dsa_cluster_sync")
                        sc[2] = sc[1] - sc[0]
                        for p in T.unroll(parts):
                            if p < rank:
                                sc[2] = sc[2] + peer(ctl, 7, p)
                        write_in_order(bits, nwords, tx, sc, p0 * 4 + out_offset, Out, row, wv)
                    if ctl[5] > 0 and rank == 0 and tx == 0:
                        Ties[row, 0] = T.reinterpret(prefix, i32)
                        Ties[row, 1] = need
                    elif use_bits == 0 and rank == 0 and tx == 0:
                        Ties[row, 1] = -1  # the finish program orders the row
                    T.call_extern("handle", "dsa_cluster_sync")  # CTA 0's counter outlives every peer's adds

        return split

    return {"radix_topk": radix_topk, "radix_finish": radix_finish, "radix_topk_split": radix_topk_split}


def _config_key(config: dict) -> tuple:
    cfg = dict(DEFAULT_CONFIG)
    cfg.update(config or {})
    parts = int(cfg.get("parts", 0) or 0)
    if parts and (cfg.get("lse") or cfg.get("agg")):
        raise ValueError(f"the split top-k (parts={parts}) writes no lse and aggregates its slots itself, got {config}")
    if parts not in (0, 2, 4, 8):
        raise ValueError(f"parts must be 0 (one CTA per row), 2, 4 or 8, got {parts}")
    if parts and cfg.get("min_blocks"):
        raise ValueError(f"the split top-k (parts={parts}) runs one cluster per row, so min_blocks does not apply, got "
                         f"{config}")
    return (int(cfg["threads"]), int(cfg["cap"]), int(cfg["unroll"]), bool(cfg.get("agg", False)),
            bool(cfg.get("lse", False)), parts, int(cfg.get("min_blocks", 0) or 0))


_BUILD_LOCK = threading.Lock()
_BUILT: dict = {}


#: the finish program's CTA shape (one program serves every select configuration)
FINISH_CONFIG = {"threads": 256, "unroll": 4}


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
    threads, cap, unroll, agg, lse, parts, min_blocks = key = _config_key(config)
    if parts:
        return _build("radix_topk_split", key, dict(threads=threads, parts=parts, cap=cap, unroll=unroll), target)
    return _build("radix_topk", key, dict(threads=threads, cap=cap, unroll=unroll, agg=agg, lse=lse,
                                          min_blocks=min_blocks), target)


def build_finish(target=None):
    """Compile the finish program: rows with more ties at the threshold than still needed take the lowest
    columns, and the rows the select program left unordered are rewritten in ascending column order."""
    params = dict(FINISH_CONFIG)
    return _build("radix_finish", tuple(params.values()), params, target)


def build_all(target=None) -> list:
    """Every shipped program: the select configurations and the finish program."""
    return [build_topk(cfg, target=target) for cfg in SHIPPED_CONFIGS] + [build_finish(target=target)]


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
    build_finish()(view, starts, ends, ties, offsets, stride, out)
    if topk > SORT_MAX_K:  # the finish program leaves such rows unordered: the same canonical order here
        out.copy_(_ascending_then_padding(out))
    return out


def _ascending_then_padding(rows):
    """Each row's entries in ascending order with the -1 padding last (int32 [R, k])."""
    import torch

    big = torch.iinfo(torch.int32).max
    ordered = torch.where(rows < 0, big, rows).sort(dim=1).values
    return torch.where(ordered == big, -1, ordered)


def topk_rows(scores, lengths, topk: int, *, config=None):
    """Exact top-k per row by radix select.

    scores [R, N] fp32 CUDA; lengths [R] int32 (valid columns 0..lengths[r]-1) or None (all N).
    Returns [R, topk] int32 column indices of the ``topk`` largest valid scores, -1 padding
    when lengths[r] < topk. Among equal scores the lowest column wins (-0.0 ties with +0.0). Each
    row comes in ascending column order, -1 padding last.
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
