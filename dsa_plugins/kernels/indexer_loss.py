"""Sparse indexer KL loss (DeepSeek-V3.2 sparse stage, DSA.md 1.2): TileLang kernels for Hopper.

For query row t and its selected slots j (topk_indices[t, j], valid when 0 <= idx < Tk):

    p[t, j]  = sum_h exp(scale * <q[t,h], kv[idx_j]> - norm[t,h])   then L1-normalised over valid j
    I[t, j]  = sum_h relu(<index_q[t,h], index_k[idx_j]>) * weights[t,h]
    loss[t]  = sum_j p[t,j] * (log p[t,j] - log_softmax_j(I[t])[j])     (0 for rows without a slot)

norm = attn_lse (logaddexp'ed with the sink when one is given), or, with attn_lse None, the
log-sum-exp of the scores over the selected slots (logaddexp'ed with the sink).

The sparse stage has two programs, one CTA per query row:

- ``attn_probs`` (the standalone loss only): the target's head sums P[t, j] = sum_h exp(S - norm):
  the 64 query heads of a CTA (grid (T, ceil(H / 64))) stay in shared memory, the kv rows are
  gathered (an invalid index is never read) and scored on wgmma, S^T = KV_blk Q^T over blocks of 64
  slots whose rows arrive in 64-column chunks through a 3-buffer cp.async pipeline (the head sum a row
  sum; two CTAs per SM), or (with the lse pass) S = Q KV_blk^T over blocks of 32 slots, the head sum a
  cross-warp reduction. With ``lse_pass`` (attn_lse None) a first sweep computes
  the per-head log-sum-exp online (a second gather of every kv row). On the fused path
  (:mod:`dsa_plugins.ops.fused_indexer_loss`) P comes from the attention backward instead and this
  program does not run: it is gather-bound (19 GB of kv rows at T 8192, k 2048, Dqk 576: 6 ms).
- ``loss``: given P, the indexer logits, the row statistics and the loss (pass 1), and with
  ``grads`` the gradients d_index_q, d_weights and d_index_k (pass 2); given lse(I) from the indexer's
  top-k (``lse_given``), one pass does both; see _loss_program. d_index_k is
  summed with fp32 atomics, or in the deterministic mode (``det``) stored per slot and summed in a fixed
  order by :mod:`.contrib_reduce`.

Index heads (at most 64) are padded to 64 by the wrapper (zero queries, zero weights); query heads
below 64 are padded inside the kernel (zero rows with norm = +inf, so they contribute nothing).

The dense warm-up loss (every key of a row's window is a slot; :func:`indexer_kl_loss_dense`) has
programs of its own, in the tiles of the indexer's logits: ``dense_target`` (the target given the
normaliser, a TMA GEMM over flat query rows: no gather), ``dense_norm`` (the normaliser when no LSE is
given, in the same tiles), and ``dense_terms`` (row statistics, loss rows and dI); its gradients come from the score-gradient
programs of :mod:`.indexer`.

TileLang is imported lazily so that this module imports without TileLang or a GPU.

Size: one file for the loss family (the attn_probs, dense and loss programs with their macros, the
config table and the Python wrapper), so that a change to the loss is read and compiled in one place.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations

import math
import os
import threading

import torch

from ..common.settings import logger
from ..common.indices import as_int32
from . import aligned_operand, announce_compile, target_key, zeros_arg
from .contrib_reduce import DET_BUDGET_BYTES, build_reduce, chunk_rows, slot_order_async

__all__ = [
    "SHIPPED_CONFIGS",
    "build_all",
    "build_attn_probs",
    "build_config",
    "build_loss",
    "indexer_kl_loss_from_probs",
    "indexer_kl_loss_sparse",
    "unsupported_reason",
]

_LOG2E = 1.4426950408889634
BLOCK_K = 64  # slots per block of the loss program (it walks them in pairs: k is padded to 128)
# The wrapper pads k to a multiple of SLOT_STEP. The programs take the padded k as a run-time number of
# steps times this constant, not as a symbol of its own: TVM then proves the slot bounds by linear
# arithmetic; with a symbolic topk_padded // 128 its simplifier took 45 of the loss program's 50 s of
# compiling (17 s now).
SLOT_STEP = 2 * BLOCK_K
ATTN_BLOCK_K = 32  # slots per block of attn_probs "sync" (heads as MMA rows; 110 KB, two CTAs per SM)
# attn_probs' layout and gather where the normaliser is given, "sync" or "chunked" (see _attn_probs_program;
# the lse pass is "sync" only); the variable is for A/B runs
ATTN_GATHER = os.environ.get("DSA_PLUGINS_ATTN_PROBS_GATHER") or None
BLOCK_H = 64  # query heads per attention CTA
THREADS = 128

#: Every configuration the package ships: (kind, compile parameters). T, Tk, k and H are run-time
#: sizes; H 16/32/64/128 share the slot-list attention programs, Hi <= 64 (padded to 64) the loss programs;
#: the dense programs are compiled per query head count (the models' 64 and 128 shipped).
SHIPPED_CONFIGS: list = [
    {"kind": "attn_probs", "dim": 576, "lse_pass": False},
    {"kind": "attn_probs", "dim": 576, "lse_pass": True},
    {"kind": "attn_probs", "dim": 512, "lse_pass": False},
    {"kind": "attn_probs", "dim": 512, "lse_pass": True},
    *({"kind": kind, "heads": heads, "dim": dim, "block_q": 4, "block_k": 128}
      for kind in ("dense_target", "dense_norm") for dim in (576, 512) for heads in (64, 128)),
    {"kind": "loss", "heads": 64, "dim": 128, "grads": True},
    {"kind": "loss", "heads": 64, "dim": 128, "grads": False},
    {"kind": "loss", "heads": 64, "dim": 128, "grads": True, "det": True},
    {"kind": "loss", "heads": 64, "dim": 128, "grads": True, "lse_given": True},
    {"kind": "loss", "heads": 64, "dim": 128, "grads": True, "det": True, "lse_given": True},
    {"kind": "dense_terms", "grads": True},
    {"kind": "dense_terms", "grads": False},
]

_KEYS = {
    "attn_probs": ("dim", "lse_pass"),
    "dense_target": ("heads", "dim", "block_q", "block_k"),
    "dense_norm": ("heads", "dim", "block_q", "block_k"),
    "dense_terms": ("grads",),
    "loss": ("heads", "dim", "grads", "det", "lse_given"),
}
_OPTIONAL = {"det": False, "lse_given": False}  # keys a config may leave out


# ----------------------------------------------------------------------------- programs
def _slot_ok(T, Idx, n_keys, row, j):
    """Slot j of query row ``row`` names a key (0 <= index < n_keys). A plain function, not a macro: no
    `and` on TIR expressions."""
    return T.And(Idx[row, j] >= 0, Idx[row, j] < n_keys)


def _attn_probs_program(dim: int, lse_pass: bool, threads: int = THREADS, gather: str | None = None,
                        chunk: int | None = None, stages: int | None = None):
    """P[hb, t, j] = sum over the heads of block hb of exp(S - norm) (see the module docstring).

    ``gather`` "chunked" (:func:`_attn_probs_chunked`): slots as MMA rows, the kv rows gathered in column
    chunks through a multi-stage cp.async pipeline. "sync": heads as MMA rows, blocks of 32 slots copied
    through registers, P's head sums reduced across warps (the first version; two CTAs per SM). Measured
    on an H100 (T 8192 / 32768, H 64, Dqk 576, k 2048, benchmarks/kernels/ab_indexer_attn_probs.py):
    attn_lse given, "chunked" with 64-column chunks through 3 buffers (two CTAs per SM) 3.90 / 15.9 ms,
    96 x 3 4.62 / 18.3, 192 x 3 (one CTA per SM) 6.51 / 26.3, 96 x 6 7.38 / 30.0; "sync" 8.83 / 33.2 (a
    double-buffered cp.async version of it: 8.54 / 33.8 with 16-slot blocks, 12.0-12.7 / 48-54 with 32 or
    64). With the lse pass a chunked version (192 x 3, running statistics per slot position and head) took
    12.8 / 56.8, "sync" 14.1 / 53.5: the lse pass is "sync" only. Default: "chunked" 64 x 3 with attn_lse."""
    if lse_pass:
        if gather not in (None, "sync"):
            raise ValueError(f"the lse pass of attn_probs has the 'sync' layout only, got gather {gather!r}")
        gather = "sync"
    # "chunked" by default where it was measured and tested: the model dims 576 and 512
    gather = gather or ATTN_GATHER or ("chunked" if dim in (512, 576) else "sync")
    if gather == "chunked":
        return _attn_probs_chunked(dim, threads, chunk, stages)
    if gather != "sync":
        raise ValueError(f"gather must be 'chunked' or 'sync', got {gather!r}")
    import tilelang.language as T

    BK, HB, D = ATTN_BLOCK_K, BLOCK_H, dim
    dtype, acc = "bfloat16", "float32"
    NT, TK, NSTEP, H, NHB = T.dynamic("n_rows, n_keys, slot_steps, heads, head_blocks")
    KP = NSTEP * SLOT_STEP  # padded k (see _slot_steps)
    NB = NSTEP * (SLOT_STEP // BK)  # slot blocks
    neg_big = -1.0e30

    def slot_ok(Idx, bx, pos):
        return _slot_ok(T, Idx, TK, bx, pos)

    @T.macro
    def gather_rows(KV, Idx, bx, i, kv_s):
        for j, d in T.Parallel(BK, D):
            kv_s[j, d] = KV[T.if_then_else(slot_ok(Idx, bx, i * BK + j), Idx[bx, i * BK + j], 0), d]

    @T.macro
    def masked_scores(Idx, bx, i, c, q_s, kv_s, s):
        # s [heads, slots] = scale * log2(e) * Q KV_blk^T, -inf on invalid slots
        T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True)
        for h, j in T.Parallel(HB, BK):
            s[h, j] = T.if_then_else(slot_ok(Idx, bx, i * BK + j), s[h, j] * c, -T.infinity(acc))

    @T.prim_func
    def main(
        Q: T.Tensor([NT, H, D], dtype),
        KV: T.Tensor([TK, D], dtype),
        Idx: T.Tensor([NT, KP], "int32"),
        Norm: T.Tensor([NT, H], acc),
        Sink: T.Tensor([H], acc),
        scale: T.float32,
        P: T.Tensor([NHB, NT, KP], acc),
    ):
        with T.Kernel(NT, NHB, threads=threads) as (bx, by):
            q_s = T.alloc_shared([HB, D], dtype)
            kv_s = T.alloc_shared([BK, D], dtype)
            norm_s = T.alloc_shared([HB], acc)
            s = T.alloc_fragment([HB, BK], acc)  # heads x slots
            pj = T.alloc_fragment([BK], acc)
            c = scale * _LOG2E
            h0 = by * HB
            for h, d in T.Parallel(HB, D):
                q_s[h, d] = T.if_then_else(h0 + h < H, Q[bx, T.min(h0 + h, H - 1), d], T.cast(0, dtype))
            if lse_pass:
                # per-head log-sum-exp over the slots (online), then the normaliser with the sink
                m_i = T.alloc_fragment([HB], acc)
                l_i = T.alloc_fragment([HB], acc)
                m_new = T.alloc_fragment([HB], acc)
                rs = T.alloc_fragment([HB], acc)
                T.fill(m_i, neg_big)
                T.fill(l_i, 0)
                for ii in T.Pipelined(NB, num_stages=1):
                    gather_rows(KV, Idx, bx, ii, kv_s)
                    masked_scores(Idx, bx, ii, c, q_s, kv_s, s)
                    T.reduce_max(s, m_new, dim=1, clear=True)
                    for h in T.Parallel(HB):
                        m_new[h] = T.max(m_new[h], m_i[h])
                    for h, j in T.Parallel(HB, BK):
                        s[h, j] = T.exp2(s[h, j] - m_new[h])
                    T.reduce_sum(s, rs, dim=1)
                    for h in T.Parallel(HB):
                        l_i[h] = l_i[h] * T.exp2(m_i[h] - m_new[h]) + rs[h]
                        m_i[h] = m_new[h]
                # norm (base 2) = log2(exp2(lse2) + exp2(sink2)); +inf for padded heads. A row is empty
                # when l_i == 0 (tested so, not l_i > 0: NaN scores keep a NaN normaliser)
                for h in T.Parallel(HB):
                    sk = Sink[T.min(h0 + h, H - 1)] * _LOG2E
                    lse2 = T.if_then_else(l_i[h] == 0, -T.infinity(acc), m_i[h] + T.log2(l_i[h]))
                    mx = T.max(lse2, sk)
                    nrm = T.if_then_else(
                        sk == -T.infinity(acc), lse2,
                        T.if_then_else(lse2 == -T.infinity(acc), sk,
                                       mx + T.log2(T.exp2(lse2 - mx) + T.exp2(sk - mx))))
                    norm_s[h] = T.if_then_else(h0 + h < H, nrm, T.infinity(acc))
            else:
                for h in T.Parallel(HB):
                    norm_s[h] = T.if_then_else(h0 + h < H, Norm[bx, T.min(h0 + h, H - 1)] * _LOG2E, T.infinity(acc))
            for i in T.Pipelined(NB, num_stages=1):
                gather_rows(KV, Idx, bx, i, kv_s)
                masked_scores(Idx, bx, i, c, q_s, kv_s, s)
                for h, j in T.Parallel(HB, BK):  # exactly 0 on invalid slots, 0 on padded heads (norm +inf)
                    s[h, j] = T.if_then_else(slot_ok(Idx, bx, i * BK + j), T.exp2(s[h, j] - norm_s[h]), 0.0)
                T.reduce_sum(s, pj, dim=0, clear=True)
                for j in T.Parallel(BK):
                    P[by, bx, i * BK + j] = pj[j]

    return main


def _attn_probs_chunked(dim: int, threads: int = THREADS, chunk: int | None = None, stages: int | None = None):
    """attn_probs with the normaliser given, the slots as MMA rows: S^T [64 slots, 64 heads] = KV_blk Q^T, so
    P's head sum is a row sum inside each thread's quad (no cross-warp reduction), and the 64 gathered kv rows
    of a block arrive in NC column chunks of ``chunk`` columns, one cp.async group each, through ``stages``
    buffers (NC a multiple of it): chunk u + stages - 1 is in flight while chunk u is multiplied (by default
    64 columns x 3 stages for dim 576, 64 x 4 for 512: q 72 KB + 24 KB of rows, two CTAs per SM). No lse
    pass: one that kept a running max and sum per (slot, head) position measured slower than "sync"'s.
    (The dense loss's target has its own program, :func:`_dense_target_program`: its keys need no gather.)"""
    import tilelang.language as T

    BK, HB, D = 64, BLOCK_H, dim
    DC = chunk or 64  # columns per chunk
    assert D % DC == 0 and DC % 16 == 0, "dim must be a multiple of the chunk, the chunk of 16"
    NC = D // DC  # chunks per block
    # buffers; chunk u of the flat order (block, chunk) lives in bufs[u % S]. 64 x 3 (dim 576; 64 x 4 for 512):
    # q 72 KB + 24 KB of rows, two CTAs per SM
    S = stages or next((n for n in (3, 4, 2) if NC % n == 0), None)
    if S is None or NC % S != 0 or S < 2:
        raise ValueError(f"attn_probs 'chunked' needs the {NC} chunks of {DC} columns per block (dim {D}) to be a "
                         f"multiple of its stages (2, 3 or 4), got stages={stages}")
    dtype, acc = "bfloat16", "float32"
    NT, TK, NSTEP, H, NHB = T.dynamic("n_rows, n_keys, slot_steps, heads, head_blocks")
    KP = NSTEP * SLOT_STEP  # padded k (see _slot_steps)
    NB = NSTEP * (SLOT_STEP // BK)  # slot blocks of 64
    VEC = 8  # bf16 per 16-byte copy
    CCOLS = DC // VEC  # copies per chunk row
    assert (BK * CCOLS) % threads == 0
    pass_ids = tuple(range(BK * CCOLS // threads))

    @T.macro
    def issue(KV, Idx, bx, blk, ch, buf, tx):
        # columns ch * DC .. of the kv rows of slot block blk into buf (zeros for invalid / past-the-end
        # slots: never read), one commit group
        for p in pass_ids:
            row = (tx + p * threads) // CCOLS
            col = ((tx + p * threads) % CCOLS) * VEC
            pos = blk * BK + row
            idx = Idx[bx, T.min(pos, KP - 1)]
            ok = T.And(pos < KP, _slot_ok(T, Idx, TK, bx, T.min(pos, KP - 1)))
            T.ptx_cp_async(T.access_ptr(buf[row, col], "w", VEC),
                           T.access_ptr(KV[T.if_then_else(ok, idx, 0), ch * DC + col], "r", VEC), VEC, ok)
        T.ptx_commit_group()

    @T.macro
    def block_scores(KV, Idx, bx, b, c, q_s, bufs, s, tx):
        # s [slots, heads] = scale * log2(e) * KV_blk Q^T for slot block b, -inf on invalid slots; chunk
        # (b, ch) lives in bufs[ch % S] (NC a multiple of S: static), the chunk S - 1 ahead in the flat order
        # goes into the buffer the previous chunk freed
        for ch in tuple(range(NC)):  # static (a tuple, not range: TileLang makes range a loop)
            ahead = ch + S - 1  # the chunk to issue, counted from block b's first
            issue(KV, Idx, bx, b + ahead // NC, ahead % NC, bufs[ahead % S], tx)
            T.ptx_wait_group(S - 1)  # chunk (b, ch) has landed; the S - 1 issued after it may not have
            T.sync_threads()
            T.fence_proxy_async()
            T.gemm(bufs[ch % S], q_s[:, ch * DC:(ch + 1) * DC], s, transpose_B=True, clear_accum=ch == 0,
                   policy=T.GemmWarpPolicy.FullCol)
            T.sync_threads()  # bufs[ch % S] is free for the next issue
        for j, hh in T.Parallel(BK, HB):
            s[j, hh] = T.if_then_else(_slot_ok(T, Idx, TK, bx, b * BK + j), s[j, hh] * c, -T.infinity(acc))

    @T.prim_func
    def main(
        Q: T.Tensor([NT, H, D], dtype),
        KV: T.Tensor([TK, D], dtype),
        Idx: T.Tensor([NT, KP], "int32"),
        Norm: T.Tensor([NT, H], acc),
        Sink: T.Tensor([H], acc),
        scale: T.float32,
        P: T.Tensor([NHB, NT, KP], acc),
    ):
        with T.Kernel(NT, NHB, threads=threads) as (bx, by):
            q_s = T.alloc_shared([HB, D], dtype)
            bufs = tuple(T.alloc_shared([BK, DC], dtype) for _ in range(S))
            norm_s = T.alloc_shared([HB], acc)
            s = T.alloc_fragment([BK, HB], acc)  # slots x heads
            pj = T.alloc_fragment([BK], acc)
            tx = T.get_thread_binding()
            c = scale * _LOG2E
            h0 = by * HB
            # (the row bound bx < NT always holds; with it ptxas spills 16 B at 255 registers, without it 116 B)
            row_ok = bx < NT
            for hh, d in T.Parallel(HB, D):
                q_s[hh, d] = T.if_then_else(T.And(h0 + hh < H, row_ok), Q[T.min(bx, NT - 1), T.min(h0 + hh, H - 1), d],
                                            T.cast(0, dtype))
            for hh in T.Parallel(HB):
                norm_s[hh] = T.if_then_else(T.And(h0 + hh < H, row_ok),
                                            Norm[T.min(bx, NT - 1), T.min(h0 + hh, H - 1)] * _LOG2E, T.infinity(acc))
            T.sync_threads()  # norm_s written
            for u in tuple(range(S - 1)):  # the first S - 1 chunks of the flat order
                issue(KV, Idx, bx, u // NC, u % NC, bufs[u], tx)
            for b in T.serial(NB):
                block_scores(KV, Idx, bx, b, c, q_s, bufs, s, tx)
                for j, hh in T.Parallel(BK, HB):  # exactly 0 on invalid slots, 0 on padded heads (norm +inf)
                    s[j, hh] = T.if_then_else(_slot_ok(T, Idx, TK, bx, b * BK + j), T.exp2(s[j, hh] - norm_s[hh]), 0.0)
                T.reduce_sum(s, pj, dim=1, clear=True)
                for j in T.Parallel(BK):
                    P[by, bx, b * BK + j] = pj[j]
            T.ptx_wait_group(0)

    return main


#: Query heads the tiled dense target takes (compile-time: the head sum is a fixed-size group of MMA columns);
#: other head counts are padded up to one of them, or split into groups of 128.
DENSE_TARGET_HEADS = (16, 32, 64, 128)


def _dense_tiling(heads: int, dim: int, block_q: int, block_k: int, chunk: int):
    """(block_q, block_k, RQ, SUB, N, NC) of the tiled dense programs, checked: RQ = min(block_q, 256 // heads)
    query rows a CTA (N = RQ x heads <= 256 (row, head) columns), SUB CTAs a score block, NC column steps of
    ``chunk`` a key block."""
    if heads not in DENSE_TARGET_HEADS:
        raise ValueError(f"the tiled dense programs take {DENSE_TARGET_HEADS} heads, got {heads}")
    if dim % chunk != 0:
        raise ValueError(f"dim must be a multiple of the chunk {chunk}, got {dim}")
    if block_k not in (64, 128):
        raise ValueError(f"block_k must be 64 or 128 (one or two consumer warpgroups), got {block_k}")
    rq = min(block_q, 256 // heads)
    if block_q % rq:
        raise ValueError(f"block_q {block_q} must be a multiple of the {rq} rows a CTA takes at {heads} heads")
    return block_q, block_k, rq, block_q // rq, rq * heads, dim // chunk


def _dense_target_program(heads: int, dim: int, block_q: int, block_k: int, chunk: int = 64, num_stages: int = 4):
    """The dense loss's attention target given the normaliser, in the tiles of the indexer's logits: for each
    score block of ``block_q`` rows and each of its key blocks [BlkLo, BlkHi) of ``block_k`` keys, the tile
    P[row, col] = sum_h exp2(c <q[row, h], kv[key]> - Norm[row, h]), col = key - BlkLo * block_k.

    A GEMM over flat query rows: S^T [block_k keys, RQ rows x heads] = KV_blk Q_blk^T, the keys the MMA rows
    (one warpgroup per 64; the head sum a row sum inside each thread's quad), both operands streamed in
    ``chunk``-column tiles by TMA (dense keys are contiguous rows: nothing to gather; a warp-specialised
    producer) through one pipeline over (key block, chunk), so the copies of the next key block overlap the
    epilogue of this one. RQ = min(block_q, 256 // heads) rows a CTA (the MMA's 256 columns); heads 128 take
    a score block of 4 rows in two CTAs. Entries outside a row's window (future keys, another sequence's
    keys, keys past the end, read as zeros) are written but mean nothing, and columns past the block's key
    range are not written at all: the row program reads only the window. Q [nq * heads, dim] bf16, KV [nk, dim] bf16, Norm [nq, heads] fp32 = the normaliser * log2(e)
    (+inf on padded heads), c = scale * log2(e), P [nq, width] fp32."""
    BQ, BK, RQ, SUB, N, NC = _dense_tiling(heads, dim, block_q, block_k, chunk)  # (checked before TileLang)
    import tilelang.language as T

    threads = 128 * (BK // 64)  # a consumer warpgroup per 64 keys (the MMA rows)
    dtype, acc = "bfloat16", "float32"
    nq, nk, width, nqb = T.dynamic("nq, nk, width, nqb")

    @T.prim_func
    def main(
        Q: T.Tensor([nq * heads, dim], dtype),
        KV: T.Tensor([nk, dim], dtype),
        Norm: T.Tensor([nq, heads], acc),
        BlkLo: T.Tensor([nqb], "int32"),
        BlkHi: T.Tensor([nqb], "int32"),
        c: T.float32,
        P: T.Tensor([nq, width], acc),
    ):
        with T.Kernel(nqb * SUB, threads=threads) as bx:
            q_s = T.alloc_shared([N, chunk], dtype)
            k_s = T.alloc_shared([BK, chunk], dtype)
            s = T.alloc_fragment([BK, N], acc)
            s3 = T.reshape(s, (BK, RQ, heads))
            nrm = T.alloc_fragment([RQ, heads], acc)
            red = T.alloc_fragment([BK, RQ], acc)
            out_s = T.alloc_shared([RQ, BK], acc)
            # last score blocks first: under a causal mask they have the most key blocks
            g = nqb * SUB - 1 - bx
            qb = g // SUB
            r0 = qb * BQ + (g % SUB) * RQ
            lo = BlkLo[qb]
            hi = T.min(BlkHi[qb], lo + width // BK)  # never past the buffer
            T.copy(Norm[r0 : r0 + RQ, :], nrm)
            T.clear(s)
            for it in T.Pipelined(T.max(hi - lo, 0) * NC, num_stages=num_stages):
                kb = lo + it // NC
                ch = it % NC
                T.copy(KV[kb * BK : (kb + 1) * BK, ch * chunk : (ch + 1) * chunk], k_s)
                T.copy(Q[r0 * heads : (r0 + RQ) * heads, ch * chunk : (ch + 1) * chunk], q_s)
                T.gemm(k_s, q_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if ch == NC - 1:
                    for a, b, h in T.Parallel(BK, RQ, heads):
                        s3[a, b, h] = T.exp2(s3[a, b, h] * c - nrm[b, h])
                    T.reduce_sum(s3, red, dim=-1, clear=True)
                    for b, a in T.Parallel(RQ, BK):
                        out_s[b, a] = red[a, b]
                    T.copy(out_s, P[r0 : r0 + RQ, (kb - lo) * BK : (kb - lo + 1) * BK])
                    T.clear(s)

    return main


def _dense_norm_program(heads: int, dim: int, block_q: int, block_k: int, chunk: int = 64, num_stages: int = 4):
    """The dense loss's attention normaliser when no LSE is given, in the tiles of :func:`_dense_target_program`:
    Norm2[row, h] = log2(sum over the row's window of exp2(c <q[row, h], kv[key]>) + exp2(Sink2[h])), the
    base-2 log-sum-exp that the target subtracts. The same TMA pipeline over (key block, column step), the
    GEMM the other way round: S [RQ rows x heads, block_k keys] = Q_blk KV_blk^T, so each (row, head) is an MMA
    row and its running max and sum (the flash-attention forward's, without P V) stay inside a thread quad.
    Keys outside the row's window [KS, KE) (buffer columns relative to BlkLo * block_k, as the plan gives them)
    are masked; an empty window with no sink gives -inf. NaN scores make the normaliser NaN (the sum keeps them).
    Q [nq * heads, dim] bf16, KV [nk, dim] bf16, KS / KE [nq] int32, Sink2 [heads] fp32 (sink * log2(e), -inf
    for none), c = scale * log2(e), Norm2 [nq * heads] fp32."""
    BQ, BK, RQ, SUB, N, NC = _dense_tiling(heads, dim, block_q, block_k, chunk)  # (checked before TileLang)
    import tilelang.language as T

    threads = 256 if N >= 128 else 128  # a consumer warpgroup per 64 or more (row, head) MMA rows
    dtype, acc = "bfloat16", "float32"
    nq, nk, nqb = T.dynamic("nq, nk, nqb")
    ninf = -T.infinity(acc)

    @T.prim_func
    def main(
        Q: T.Tensor([nq * heads, dim], dtype),
        KV: T.Tensor([nk, dim], dtype),
        KS: T.Tensor([nq], "int32"),
        KE: T.Tensor([nq], "int32"),
        BlkLo: T.Tensor([nqb], "int32"),
        BlkHi: T.Tensor([nqb], "int32"),
        Sink2: T.Tensor([heads], acc),
        c: T.float32,
        Norm2: T.Tensor([nq * heads], acc),
    ):
        with T.Kernel(nqb * SUB, threads=threads) as bx:
            q_s = T.alloc_shared([N, chunk], dtype)
            k_s = T.alloc_shared([BK, chunk], dtype)
            win_s = T.alloc_shared([2, RQ], "int32")
            s = T.alloc_fragment([N, BK], acc)
            s3 = T.reshape(s, (RQ, heads, BK))
            m_i = T.alloc_fragment([N], acc)
            l_i = T.alloc_fragment([N], acc)
            m_new = T.alloc_fragment([N], acc)
            rs = T.alloc_fragment([N], acc)
            g = nqb * SUB - 1 - bx  # last score blocks first (the longest under a causal mask)
            qb = g // SUB
            r0 = qb * BQ + (g % SUB) * RQ
            lo = BlkLo[qb]
            hi = BlkHi[qb]
            for u, b in T.Parallel(2, RQ):  # the rows' windows, read once (past the last row: empty)
                win_s[u, b] = T.if_then_else(r0 + b < nq, T.if_then_else(u == 0, KS[T.min(r0 + b, nq - 1)],
                                                                         KE[T.min(r0 + b, nq - 1)]), 0)
            T.fill(m_i, ninf)
            T.fill(l_i, 0)
            T.clear(s)
            for it in T.Pipelined(T.max(hi - lo, 0) * NC, num_stages=num_stages):
                kb = lo + it // NC
                ch = it % NC
                T.copy(Q[r0 * heads : (r0 + RQ) * heads, ch * chunk : (ch + 1) * chunk], q_s)
                T.copy(KV[kb * BK : (kb + 1) * BK, ch * chunk : (ch + 1) * chunk], k_s)
                T.gemm(q_s, k_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if ch == NC - 1:
                    for b, h, j in T.Parallel(RQ, heads, BK):
                        col = (kb - lo) * BK + j
                        s3[b, h, j] = T.if_then_else(T.And(col >= win_s[0, b], col < win_s[1, b]), s3[b, h, j] * c,
                                                     ninf)
                    T.reduce_max(s, m_new, dim=1, clear=True)
                    for i in T.Parallel(N):
                        m_new[i] = T.max(m_new[i], m_i[i])
                    for i, j in T.Parallel(N, BK):  # (a max of -inf: nothing seen yet, every term 0)
                        s[i, j] = T.exp2(s[i, j] - T.if_then_else(m_new[i] == ninf, 0.0, m_new[i]))
                    T.reduce_sum(s, rs, dim=1, clear=True)
                    for i in T.Parallel(N):
                        l_i[i] = l_i[i] * T.exp2(m_i[i] - T.if_then_else(m_new[i] == ninf, 0.0, m_new[i])) + rs[i]
                        m_i[i] = m_new[i]
                    T.clear(s)
            # log2(sum) logaddexp2'ed with the sink; an empty window (l == 0: not l > 0, a NaN stays NaN) is -inf
            for i in T.Parallel(N):
                sk = Sink2[i % heads]
                lse2 = T.if_then_else(l_i[i] == 0, ninf, m_i[i] + T.log2(l_i[i]))
                mx = T.max(lse2, sk)
                nrm = T.if_then_else(sk == ninf, lse2, T.if_then_else(
                    lse2 == ninf, sk, mx + T.log2(T.exp2(lse2 - mx) + T.exp2(sk - mx))))
                if r0 * heads + i < nq * heads:
                    Norm2[r0 * heads + i] = nrm

    return main


def _loss_program(heads: int, dim: int, grads: bool, det: bool = False, threads: int = 128, ablate: str = "",
                  lse_given: bool = False):
    """One CTA per query row, given the attention target P (head sums, unnormalised):

    pass 1 over the slot blocks: I_j = sum_h relu(<iq_h, ik_j>) w_h (kept in the workspace Iw)
    and per-lane running row statistics (max and rescaled sum of exp(I) for lse(I), sum P, sum P*I, sum P*log P);
    then the row's KL = (sum P log P - sum P I) / psum - log psum + lse, written to Loss;
    pass 2 (``grads``): dI_j = G * (exp(I_j - lse) - P_j / psum), then from L = IK_blk IQ^T recomputed:
    d_index_q (wgmma), d_weights and d_index_k (64 columns at a time, fp32 atomics).

    The index_k rows of each block are gathered with predicated cp.async into two shared buffers:
    block b + 1 is in flight while block b is computed (an invalid index is never read).
    Without ``grads`` (the loss value only) G, DIQ, DW and DK are not touched.
    ``ablate`` (benchmarks only, wrong gradients): "no_atomics" skips the d_index_k scatter.
    ``lse_given`` (with ``grads``): Lse [T] holds lse(I) over the row's slots (the indexer's forward
    computed it from the scores it selected by) and Psum [T] the row sums of P, so there is no pass 1:
    pass 2 forms I_j from the logits it recomputes anyway (relu, weights, head sum) and accumulates
    sum P I and sum P log P for the loss value. Pass 1 is a whole second gather of the index_k rows with its
    MMAs: about 18% of the program with gradients.
    ``det`` (the deterministic mode, with ``grads``): DK is a contribution buffer [T * kp, D] instead,
    each valid slot's d_index_k row stored in row t * kp + slot (plain stores; invalid slots store
    nothing), for :mod:`.contrib_reduce` to sum in a fixed order.

    Measured on an H200 (T 8192, k 2048, causal top-k, Hi 64, Di 128): 6.3 ms with gradients, of
    which pass 1 is 1.2 ms and the d_index_k atomics 2.0 ms (2.1 G fp32 adds: about the rate at
    which L2 takes fp32 reductions, as in the attention backward's dkv; alone, that scatter takes
    3.2 ms: benchmarks/results/scatter_floor.md). 256 threads (heads split over two warpgroups):
    8.75 ms, slower. The d_index_k rows staged in shared memory and sent as TMA bulk reductions:
    8.54 ms, slower. Each 64 x 64 tile regrouped by shuffles and sent as full-line red.v4 (the attention
    backward's dkv helper): 6.73 vs 6.39 ms at T 8192 and 26.7 vs 25.2 ms at T 32768 (H200, same run,
    d_index_k within 1e-5), slower: without warp specialisation the shuffles sit on the MMAs' path."""
    import tilelang.language as T

    BK, HI, D = BLOCK_K, heads, dim
    dtype, acc = "bfloat16", "float32"
    NT, TK, NSTEP = T.dynamic("n_rows, n_keys, slot_steps")
    KP = NSTEP * SLOT_STEP  # padded k (see _slot_steps)
    DK_ROWS = T.dynamic("n_contrib") if det else TK  # det: one contribution row per (row, slot)
    VEC = 8  # bf16 per 16-byte copy
    COLS = D // VEC  # copies per row
    DC = 64 if D % 64 == 0 else D  # d_index_k columns per MMA + scatter step
    assert (BK * COLS) % threads == 0, "index dim must be a multiple of 16"
    pass_ids = tuple(range(BK * COLS // threads))  # copies per thread and block
    neg_inf = -T.infinity(acc)

    @T.macro
    def issue(Idx, IK, bx, blk, buf, tx):
        # gather the index_k rows of slot block blk into buf (zeros for invalid / past-the-end slots)
        for p in pass_ids:
            row = (tx + p * threads) // COLS
            col = ((tx + p * threads) % COLS) * VEC
            pos = blk * BK + row
            idx = Idx[bx, T.min(pos, KP - 1)]
            ok = (pos < KP) and (idx >= 0) and (idx < TK)
            T.ptx_cp_async(T.access_ptr(buf[row, col], "w", VEC),
                           T.access_ptr(IK[T.if_then_else(ok, idx, 0), col], "r", VEC), VEC, ok)
        T.ptx_commit_group()

    @T.macro
    def land():
        # the group of the current block has landed (the next one may stay in flight)
        T.ptx_wait_group(1)
        T.sync_threads()
        T.fence_proxy_async()

    def relu(x):
        # not T.max(x, 0): fmaxf would turn a NaN logit into 0
        return T.if_then_else(x < 0, T.cast(0, acc), x)

    @T.macro
    def logits(Idx, bx, blk, buf, iq_s, w_s, lt, ival, lw):
        # lt = L = IK_blk IQ^T (slots x heads), lw = relu(L) w (lt itself where L is not needed after) and
        # ival[j] = I_j, the head sum of lw (-inf for invalid slots)
        T.gemm(buf, iq_s, lt, transpose_B=True, clear_accum=True)
        for j, h in T.Parallel(BK, HI):
            lw[j, h] = relu(lt[j, h]) * w_s[h]
        T.reduce_sum(lw, ival, dim=1, clear=True)
        for j in T.Parallel(BK):
            ival[j] = T.if_then_else((Idx[bx, blk * BK + j] >= 0) and (Idx[bx, blk * BK + j] < TK), ival[j], neg_inf)

    @T.macro
    def stats_block(Idx, P, Iw, bx, blk, ival, m_l, s_l, ps_l, pi_l, pl_l):
        # slots are decided by their index, terms by pj == 0 (not by value tests that a NaN fails)
        for j in T.Parallel(BK):
            Iw[bx, blk * BK + j] = ival[j]
            pj = T.if_then_else(_slot_ok(T, Idx, TK, bx, blk * BK + j), P[bx, blk * BK + j], 0.0)
            m_new = T.max(m_l[j], ival[j])
            s_l[j] = T.if_then_else(
                m_new > neg_inf, s_l[j] * T.exp(m_l[j] - m_new) + T.exp(ival[j] - m_new), 0.0)
            m_l[j] = m_new
            ps_l[j] += pj
            pi_l[j] += T.if_then_else(pj == 0, 0.0, pj * ival[j])
            pl_l[j] += T.if_then_else(pj == 0, 0.0, pj * T.log(pj))

    @T.macro
    def grad_block(Idx, P, Iw, DK, bx, blk, buf, iq_s, w_s, lt, gacc, acc_q, acc_k, dl_s, d_s, row_s, lw, ival, pi_l,
                   pl_l):
        if lse_given:
            # I_j from the logits recomputed here (L stays in lt for the gradients below)
            logits(Idx, bx, blk, buf, iq_s, w_s, lt, ival, lw)
            for j in T.Parallel(BK):
                pj = T.if_then_else(_slot_ok(T, Idx, TK, bx, blk * BK + j), P[bx, blk * BK + j], 0.0)
                d_s[j] = T.if_then_else(
                    _slot_ok(T, Idx, TK, bx, blk * BK + j), row_s[4] * (T.exp(ival[j] - row_s[0]) - pj * row_s[1]), 0.0)
                # the loss value's sums P I and P log P, as in stats_block
                pi_l[j] += T.if_then_else(pj == 0, 0.0, pj * ival[j])
                pl_l[j] += T.if_then_else(pj == 0, 0.0, pj * T.log(pj))
        else:
            # dI_j = G (softmax_j - p_j), with I_j from pass 1 (-inf for invalid slots)
            for j in T.Parallel(BK):
                d_s[j] = T.if_then_else(
                    _slot_ok(T, Idx, TK, bx, blk * BK + j),
                    row_s[4] * (T.exp(Iw[bx, blk * BK + j] - row_s[0]) - P[bx, blk * BK + j] * row_s[1]), 0.0)
            T.gemm(buf, iq_s, lt, transpose_B=True, clear_accum=True)  # L (slots x heads)
        for j, h in T.Parallel(BK, HI):
            # relu's gradient as torch takes it: zero where L <= 0 (a NaN logit passes d on)
            gacc[j, h] += T.if_then_else(_slot_ok(T, Idx, TK, bx, blk * BK + j), d_s[j] * relu(lt[j, h]), 0.0)
            dl_s[j, h] = T.cast(T.if_then_else(lt[j, h] <= 0, 0.0, d_s[j] * w_s[h]), dtype)
        T.gemm(dl_s, buf, acc_q, transpose_A=True)
        # d_index_k rows of the block, DC columns at a time (fewer registers: more CTAs per SM)
        for c in T.unroll(D // DC):
            T.gemm(dl_s, iq_s[:, c * DC:(c + 1) * DC], acc_k, clear_accum=True)
            if det:
                for j, d in T.Parallel(BK, DC):
                    if (Idx[bx, blk * BK + j] >= 0) and (Idx[bx, blk * BK + j] < TK):
                        DK[bx * KP + blk * BK + j, c * DC + d] = acc_k[j, d]
            elif ablate != "no_atomics":
                for j, d in T.Parallel(BK, DC):
                    if (Idx[bx, blk * BK + j] >= 0) and (Idx[bx, blk * BK + j] < TK):
                        T.atomic_add(DK[Idx[bx, blk * BK + j], c * DC + d], acc_k[j, d])

    @T.prim_func
    def main(
        IQ: T.Tensor([NT, HI, D], dtype),
        IK: T.Tensor([TK, D], dtype),
        W: T.Tensor([NT, HI], acc),
        Idx: T.Tensor([NT, KP], "int32"),
        P: T.Tensor([NT, KP], acc),
        G: T.Tensor([NT], acc),
        Iw: T.Tensor([1] if lse_given else [NT, KP], acc),
        Lse: T.Tensor([NT] if lse_given else [1], acc),
        Psum: T.Tensor([NT] if lse_given else [1], acc),
        Loss: T.Tensor([NT], acc),
        DIQ: T.Tensor([NT, HI, D], dtype),
        DW: T.Tensor([NT, HI], acc),
        DK: T.Tensor([DK_ROWS, D], acc),
    ):
        with T.Kernel(NT, threads=threads) as bx:
            iq_s = T.alloc_shared([HI, D], dtype)
            ik0 = T.alloc_shared([BK, D], dtype)  # index_k rows of a block, double buffered
            ik1 = T.alloc_shared([BK, D], dtype)
            bufs = (ik0, ik1)
            w_s = T.alloc_shared([HI], acc)
            row_s = T.alloc_shared([8], acc)  # lse, 1/psum, psum, sum P I, G, sum P log P
            lt = T.alloc_fragment([BK, HI], acc)
            ival = T.alloc_fragment([BK], acc)
            m_l = None if lse_given else T.alloc_fragment([BK], acc)  # pass 1's running lse(I)
            s_l = None if lse_given else T.alloc_fragment([BK], acc)
            ps_l = None if lse_given else T.alloc_fragment([BK], acc)
            pi_l = T.alloc_fragment([BK], acc)
            pl_l = T.alloc_fragment([BK], acc)
            red = T.alloc_fragment([1], acc)
            m_row = None if lse_given else T.alloc_fragment([1], acc)
            tx = T.get_thread_binding()
            T.copy(IQ[bx, :, :], iq_s)
            for h in T.Parallel(HI):
                w_s[h] = W[bx, h]
            if not lse_given:
                T.fill(m_l, neg_inf)
                T.fill(s_l, 0)
                T.fill(ps_l, 0)
            T.fill(pi_l, 0)
            T.fill(pl_l, 0)

            if lse_given:
                # the row's lse(I) and psum come in (a sweep over P here would wait on one load after another)
                if tx == 0:
                    row_s[0] = Lse[bx]
                    row_s[2] = Psum[bx]
                    row_s[1] = T.if_then_else(Psum[bx] == 0, 0.0, 1.0 / Psum[bx])
                    row_s[4] = G[bx]
                T.sync_threads()
            else:
                # pass 1: logits and row statistics
                issue(Idx, IK, bx, 0, bufs[0], tx)
                for t in T.serial(NSTEP):
                    for st in (0, 1):  # static: block 2t + st computes on bufs[st], the next one lands in the other
                        issue(Idx, IK, bx, 2 * t + st + 1, bufs[1 - st], tx)
                        land()
                        logits(Idx, bx, 2 * t + st, bufs[st], iq_s, w_s, lt, ival, lt)
                        stats_block(Idx, P, Iw, bx, 2 * t + st, ival, m_l, s_l, ps_l, pi_l, pl_l)
                        T.sync_threads()  # bufs[st] is free

                # combine the lanes: lse(I), psum, sum P I, sum P log P -> the row's KL
                T.reduce_max(m_l, m_row, dim=0, clear=True)
                for j in T.Parallel(BK):
                    s_l[j] = T.if_then_else(m_l[j] > neg_inf, s_l[j] * T.exp(m_l[j] - m_row[0]), 0.0)
                T.reduce_sum(s_l, red, dim=0, clear=True)
                if tx == 0:  # red >= 1 (the lane holding the max adds exp(0)) unless NaN: no clamp
                    row_s[0] = T.if_then_else(m_row[0] > neg_inf, m_row[0] + T.log(red[0]), neg_inf)
                T.reduce_sum(ps_l, red, dim=0, clear=True)
                if tx == 0:
                    row_s[2] = red[0]
                    row_s[1] = T.if_then_else(red[0] == 0, 0.0, 1.0 / red[0])
                T.reduce_sum(pi_l, red, dim=0, clear=True)
                if tx == 0:
                    row_s[3] = red[0]
                T.reduce_sum(pl_l, red, dim=0, clear=True)
                if tx == 0:
                    psum = row_s[2]
                    Loss[bx] = T.if_then_else(  # == 0, not > 0: a NaN target gives a NaN loss
                        psum == 0, 0.0, (red[0] - row_s[3]) * row_s[1] - T.log(psum) + row_s[0])
                    if grads:
                        row_s[4] = G[bx]
                T.sync_threads()

            if grads:  # pass 2 (its buffers are allocated here)
                dl_s = T.alloc_shared([BK, HI], dtype)
                d_s = T.alloc_shared([BK], acc)
                g_s = T.alloc_shared([BK, HI], acc)
                gacc = T.alloc_fragment([BK, HI], acc)
                acc_q = T.alloc_fragment([HI, D], acc)
                acc_k = T.alloc_fragment([BK, DC], acc)
                gt = T.alloc_fragment([HI, BK], acc)
                dw_f = T.alloc_fragment([HI], acc)
                # relu(L) w for the head sum: acc_k's registers where it is a 64 x 64 accumulator like L (free
                # until the d_index_k MMA), else a fragment of its own
                lw = (acc_k if DC == HI else T.alloc_fragment([BK, HI], acc)) if lse_given else None
                T.fill(acc_q, 0)
                T.fill(gacc, 0)
                if not lse_given:
                    T.ptx_wait_group(0)  # pass 1's last (empty) prefetch has landed before bufs[0] is reused
                    T.sync_threads()
                # pass 2 (or the only pass): gradients (the gathered rows are in L2 from pass 1, if any)
                issue(Idx, IK, bx, 0, bufs[0], tx)
                for t in T.serial(NSTEP):
                    for st in (0, 1):
                        issue(Idx, IK, bx, 2 * t + st + 1, bufs[1 - st], tx)
                        land()
                        grad_block(Idx, P, Iw, DK, bx, 2 * t + st, bufs[st], iq_s, w_s, lt, gacc, acc_q, acc_k, dl_s,
                                   d_s, row_s, lw, ival, pi_l, pl_l)
                        T.sync_threads()
                if lse_given:
                    # the loss value from the sums P I and P log P of the pass
                    T.reduce_sum(pi_l, red, dim=0, clear=True)
                    if tx == 0:
                        row_s[3] = red[0]
                    T.reduce_sum(pl_l, red, dim=0, clear=True)
                    if tx == 0:
                        Loss[bx] = T.if_then_else(  # == 0, not > 0: a NaN target gives a NaN loss
                            row_s[2] == 0, 0.0, (red[0] - row_s[3]) * row_s[1] - T.log(row_s[2]) + row_s[0])
                # d_weights[h] = sum_j dI_j relu(L_jh)
                T.copy(gacc, g_s)
                for h, j in T.Parallel(HI, BK):
                    gt[h, j] = g_s[j, h]
                T.reduce_sum(gt, dw_f, dim=1, clear=True)
                for h in T.Parallel(HI):
                    DW[bx, h] = dw_f[h]
                for h, d in T.Parallel(HI, D):
                    DIQ[bx, h, d] = T.cast(acc_q[h, d], dtype)
            T.ptx_wait_group(0)

    return main


def _dense_terms_program(grads: bool, threads: int = 256):
    """The dense loss's row statistics, loss rows and dI, one CTA per row of a chunk's buffers.

    I [R, W] fp32: the indexer logits (the score program's buffer), P [R, W] fp32: the target's head sums,
    both read only inside the row's window [KS, KE) (buffer columns); G [R] fp32: d objective / d loss row.
    Pass 1: lse(I) (online max and sum; a NaN logit makes it NaN) and sum(P); pass 2: the loss row
    sum p (log p - I + lse) with p = P / sum(P) (a term is 0 where p == 0), and with ``grads``
    dI = G (exp(I - lse) - p), written over I on the whole row (0 outside the window)."""
    import tilelang.language as T

    f32 = "float32"
    R, W = T.dynamic("rows, width")
    strides = []
    n = threads // 2
    while n >= 1:
        strides.append(n)
        n //= 2
    strides = tuple(strides)

    @T.macro
    def tree_sum(red, tx):
        # red[0] = the sum of red[0:threads] (a NaN anywhere makes it NaN)
        for stride in strides:
            T.sync_threads()
            if tx < stride:
                red[tx] = red[tx] + red[tx + stride]
        T.sync_threads()

    @T.macro
    def tree_max(red, tx):
        for stride in strides:
            T.sync_threads()
            if tx < stride:
                red[tx] = T.max(red[tx], red[tx + stride])
        T.sync_threads()

    @T.prim_func
    def main(
        I: T.Tensor([R, W], f32),
        P: T.Tensor([R, W], f32),
        KS: T.Tensor([R], "int32"),
        KE: T.Tensor([R], "int32"),
        G: T.Tensor([R], f32),
        Loss: T.Tensor([R], f32),
    ):
        with T.Kernel(R, threads=threads) as bx:
            tx = T.get_thread_binding()
            red = T.alloc_shared([threads], f32)
            red2 = T.alloc_shared([threads], f32)
            m = T.alloc_var(f32)
            se = T.alloc_var(f32)
            ps = T.alloc_var(f32)
            nz = T.alloc_var(f32)
            m_row = T.alloc_var(f32)
            lse = T.alloc_var(f32)
            psum = T.alloc_var(f32)
            acc = T.alloc_var(f32)
            ks = T.max(KS[bx], 0)
            ke = T.min(KE[bx], W)
            m = -T.infinity(f32)
            se = 0.0
            ps = 0.0
            nz = 0.0  # 0, or a NaN logit of the thread's (fmaxf drops NaN: it is carried by a sum)
            for i in T.serial(T.ceildiv(T.max(ke - ks, 0), threads)):
                c = ks + i * threads + tx
                if c < ke:
                    x = I[bx, c]
                    ps = ps + P[bx, c]
                    if T.isnan(x):
                        nz = x
                    elif x > m:
                        se = se * T.exp2((m - x) * _LOG2E) + 1.0
                        m = x
                    else:
                        se = se + T.exp2((x - m) * _LOG2E)
            red[tx] = m
            tree_max(red, tx)
            m_row = red[0]
            T.sync_threads()
            red[tx] = T.if_then_else(m == -T.infinity(f32), 0.0, se * T.exp2((m - m_row) * _LOG2E))
            red2[tx] = ps + nz * 0.0
            tree_sum(red, tx)
            lse = m_row + T.log(red[0])  # -inf for a row without a key
            T.sync_threads()
            red[tx] = nz
            tree_sum(red, tx)
            lse = lse + red[0]  # + 0, or NaN
            tree_sum(red2, tx)
            psum = red2[0]
            T.sync_threads()
            acc = 0.0
            for i in T.serial(T.ceildiv(W, threads)):
                c = i * threads + tx
                if c < W:
                    inside = T.And(c >= ks, c < ke)
                    p = T.if_then_else(psum == 0.0, 0.0, T.if_then_else(inside, P[bx, c], 0.0) / psum)
                    logq = I[bx, c] - lse
                    if inside and p != 0.0:
                        acc = acc + p * (T.log(T.max(p, 1.1754944e-38)) - logq)
                    if grads:
                        I[bx, c] = T.if_then_else(inside, (T.exp2(logq * _LOG2E) - p) * G[bx], 0.0)
            red[tx] = acc
            tree_sum(red, tx)
            if tx == 0:
                Loss[bx] = red[0]

    return main


_PROGRAMS = {
    "attn_probs": _attn_probs_program,
    "dense_target": _dense_target_program,
    "dense_norm": _dense_norm_program,
    "loss": _loss_program,
    "dense_terms": _dense_terms_program,
}


# ----------------------------------------------------------------------------- building
def _normalise(config: dict) -> tuple:
    kind = config.get("kind")
    if kind not in _KEYS:
        raise ValueError(f"config kind must be one of {sorted(_KEYS)}, got {kind!r}")
    out = []
    for k in _KEYS[kind]:
        if k not in config and k not in _OPTIONAL:
            raise ValueError(f"{kind} config needs {k!r}")
        v = config.get(k, _OPTIONAL.get(k))
        out.append((k, bool(v) if k in ("lse_pass", "grads", "det", "lse_given") else int(v)))
    params = dict(out)
    if params.get("det") and not params["grads"]:
        raise ValueError("a deterministic loss program (det) needs grads: it changes how d_index_k is summed")
    if params.get("lse_given") and not params["grads"]:
        raise ValueError("a loss program with lse_given needs grads: the value alone needs the logits' pass anyway")
    if "dim" in params and (params["dim"] % 16 != 0 or not 16 <= params["dim"] <= 1024):
        raise ValueError(f"dim must be a multiple of 16 in [16, 1024], got {params['dim']}")
    if kind == "loss" and params["heads"] != 64:
        raise ValueError(f"indexer heads are padded to 64, got {params['heads']}")
    if kind in ("dense_target", "dense_norm") and params["heads"] not in DENSE_TARGET_HEADS:
        raise ValueError(f"the dense target takes heads in {DENSE_TARGET_HEADS}, got {params['heads']}")
    return (kind,) + tuple(out)


@torch.compiler.disable
def _device_target(device: torch.device) -> dict:
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"kind": "cuda", "arch": f"sm_{major}{minor}" + ("a" if major == 9 else "")}


_BUILD_LOCK = threading.Lock()
_BUILT: dict = {}


def _build(config: dict, target):
    import tilelang

    key = _normalise(config)
    tkey = target_key(target)
    kern = _BUILT.get((key, tkey))
    if kern is not None:
        return kern
    kind, params = key[0], dict(key[1:])
    with _BUILD_LOCK:  # TIR construction is not thread-safe; nvcc below runs in parallel
        kern = _BUILT.get((key, tkey))
        if kern is not None:
            return kern
        func = _PROGRAMS[kind](**params)
    announce_compile(f"indexer loss {kind}")
    kern = tilelang.compile(
        func, target=target, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
        compile_flags=["-O3", "-DNDEBUG"],
    )
    logger.info("compiled TileLang indexer_loss %s %s target=%s", kind, params, tkey)
    with _BUILD_LOCK:
        return _BUILT.setdefault((key, tkey), kern)


def build_attn_probs(dim: int, lse_pass: bool, target="auto"):
    """Compile the attention-probability program (slot lists) for Dqk ``dim``."""
    return _build({"kind": "attn_probs", "dim": dim, "lse_pass": lse_pass}, target)


def build_dense_target(heads: int, dim: int, block_q: int = 4, block_k: int = 128, target="auto"):
    """Compile the dense loss's tiled attention target for ``heads`` query heads (DENSE_TARGET_HEADS), Dqk
    ``dim`` and the indexer plan's score blocks (``block_q`` rows x ``block_k`` keys)."""
    return _build({"kind": "dense_target", "heads": heads, "dim": dim, "block_q": block_q, "block_k": block_k},
                  target)


def build_dense_norm(heads: int, dim: int, block_q: int = 4, block_k: int = 128, target="auto"):
    """Compile the dense loss's tiled normaliser (no LSE given) for ``heads`` query heads (DENSE_TARGET_HEADS),
    Dqk ``dim`` and the indexer plan's score blocks."""
    return _build({"kind": "dense_norm", "heads": heads, "dim": dim, "block_q": block_q, "block_k": block_k},
                  target)


def build_loss(dim: int, grads: bool, target="auto", det: bool = False, lse_given: bool = False):
    """Compile the loss program for index head dim ``dim`` (64 padded index heads); ``det``: d_index_k as
    contribution rows for the deterministic reduce; ``lse_given``: lse(I) is an input (no pass 1)."""
    return _build({"kind": "loss", "heads": 64, "dim": dim, "grads": grads, "det": det, "lse_given": lse_given},
                  target)


def build_dense_terms(grads: bool, target="auto"):
    """Compile the dense loss's row program (row statistics, loss rows, and with ``grads`` dI)."""
    return _build({"kind": "dense_terms", "grads": grads}, target)


def build_config(config: dict, target="auto"):
    """Compile any SHIPPED_CONFIGS entry (dispatch on its "kind")."""
    return _build(config, target)


def build_all(target="auto"):
    """Compile every shipped configuration."""
    return [build_config(cfg, target=target) for cfg in SHIPPED_CONFIGS]


# ----------------------------------------------------------------------------- wrappers
def unsupported_reason(num_heads: int, dqk: int, index_heads: int, index_dim: int, dtype=None):
    """None when the TileLang sparse indexer loss handles these sizes, else a one-line reason."""
    if dtype is not None and dtype != torch.bfloat16:
        return f"the TileLang indexer loss takes bfloat16 q/kv/index_q/index_k, got {dtype}"
    if num_heads < 1:
        return f"num_heads must be >= 1, got {num_heads}"
    if dqk % 64 != 0 or not 64 <= dqk <= 576:
        return f"the TileLang indexer loss needs Dqk a multiple of 64 in [64, 576], got {dqk}"
    if not 1 <= index_heads <= 64:
        return f"the TileLang indexer loss supports 1..64 index heads, got {index_heads}"
    if index_dim % 16 != 0 or not 16 <= index_dim <= 256:
        return f"the TileLang indexer loss needs an index head dim that is a multiple of 16 in [16, 256], got {index_dim}"
    return None


def _check(name, t, dtypes, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes or not t.is_cuda or (device is not None and t.device != device):
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        where = device if device is not None else "a CUDA device"
        raise ValueError(f"{name} must be {want} on {where}, got {str(t.dtype).replace('torch.', '')} on {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _pad_heads(index_q, weights, hp: int = 64):
    """index_q and fp32 weights padded to ``hp`` heads (zero queries and weights: they add nothing)."""
    hi = index_q.shape[1]
    iq = aligned_operand(index_q)
    w = aligned_operand(weights.float())
    if hp != hi:
        iq = torch.nn.functional.pad(iq, (0, 0, 0, hp - hi))
        w = torch.nn.functional.pad(w, (0, hp - hi))
    return iq, w, hp


def _check_indexer(index_q, index_k, weights, topk_indices, grad_rows, windows=None):
    """Checks of the indexer inputs and the slots: topk_indices [T, k] (sparse), or windows = (key_start,
    key_end) [T] each (dense)."""
    _check("index_q", index_q, (torch.bfloat16,), 3)
    dev = index_q.device
    t, hi, di = index_q.shape
    _check("index_k", index_k, (torch.bfloat16,), 2, dev)
    _check("weights", weights, (torch.float32, torch.bfloat16, torch.float16), 2, dev)
    if windows is None:
        _check("topk_indices", topk_indices, (torch.int32, torch.int64), 2, dev)
        if topk_indices.shape[0] != t:
            raise ValueError(f"topk_indices must be [T={t}, k], got {tuple(topk_indices.shape)}")
    for name, x in zip(("key_start", "key_end"), windows or ()):
        _check(name, x, (torch.int32, torch.int64), 1, dev)
        if x.shape[0] != t:
            raise ValueError(f"{name} must be [T={t}], got {tuple(x.shape)}")
    if tuple(weights.shape) != (t, hi):
        raise ValueError(f"weights must be [{t}, {hi}], got {tuple(weights.shape)}")
    if index_k.shape[1] != di:
        raise ValueError(f"index_k must be [Tk, Di={di}], got {tuple(index_k.shape)}")
    if grad_rows is not None:
        _check("grad_rows", grad_rows, (torch.float32,), 1, dev)
        if grad_rows.shape[0] != t:
            raise ValueError(f"grad_rows must be [T={t}], got {tuple(grad_rows.shape)}")


def _slots(topk_indices, tk):
    """(idx [T, kp] int32 with -1 for invalid slots and the padding, valid [T, k], kp)."""
    k = topk_indices.shape[1]
    kp = max(1, -(-k // SLOT_STEP)) * SLOT_STEP  # the loss program walks the slot blocks in pairs
    idx = as_int32(topk_indices, tk)
    valid = (idx >= 0) & (idx < tk)
    idx = torch.where(valid, idx, -1)
    if kp != k:
        idx = torch.nn.functional.pad(idx, (0, kp - k), value=-1)
    return idx.contiguous(), valid, kp


_DET_BUDGET_BYTES = DET_BUDGET_BYTES  # the contribution buffer's bytes at most (tests patch it)


def _run_loss(index_q, index_k, weights, idx, probs, grad_rows, deterministic=False, index_lse=None):
    """The loss program on checked inputs; idx [T, kp] and probs [T, kp] padded. Returns
    (loss_rows, (d_index_q, d_index_k, d_weights) or None); ``deterministic``: d_index_k summed in a
    fixed order (:func:`_run_deterministic`) instead of with fp32 atomics. ``index_lse`` [T] fp32 (with
    gradients): lse(I) over the row's slots, from the indexer's forward; the program then skips pass 1."""
    dev = index_q.device
    t, hi, di = index_q.shape
    tk = index_k.shape[0]
    kp = idx.shape[1]
    if max(t * kp, t * 64 * di, tk * di) >= 2**31:
        raise ValueError("indexer_kl_loss: tensors of 2**31 or more elements are not supported (int32 offsets)")
    grads = grad_rows is not None
    d_ik = torch.zeros(tk, di, dtype=torch.float32, device=dev)
    if t == 0 or tk == 0:
        zero_grads = (torch.zeros_like(index_q), d_ik, torch.zeros(t, hi, dtype=torch.float32, device=dev))
        return torch.zeros(t, dtype=torch.float32, device=dev), (zero_grads if grads else None)
    iq, w, hp = _pad_heads(index_q, weights)
    loss = torch.empty(t, dtype=torch.float32, device=dev)
    lse_given = grads and index_lse is not None
    if lse_given:  # no pass 1: no logits workspace; the row sums of P (0 on invalid slots) from torch
        logits_ws, lse, psum = zeros_arg(1, torch.float32, dev), index_lse.contiguous(), probs.sum(1)
    else:  # I of pass 1, read by pass 2
        logits_ws = torch.empty(t, kp, dtype=torch.float32, device=dev)
        lse = psum = zeros_arg(1, torch.float32, dev)
    if grads:
        d_iq = torch.empty(t, hp, di, dtype=torch.bfloat16, device=dev)
        d_w = torch.empty(t, hp, dtype=torch.float32, device=dev)
        g = grad_rows.contiguous()
    else:  # not touched by the value-only program (shapes only)
        d_iq, d_w, g = iq, w, loss
    with torch.cuda.device(dev):
        if grads and deterministic:
            _run_deterministic(iq, aligned_operand(index_k), w, idx, probs.contiguous(), g, logits_ws, lse, psum,
                               lse_given, loss, d_iq, d_w, d_ik)
        else:
            build_loss(di, grads, _device_target(dev), lse_given=lse_given)(
                iq, aligned_operand(index_k), w, idx, probs.contiguous(), g, logits_ws, lse, psum, loss, d_iq, d_w, d_ik)
    if not grads:
        return loss, None
    if hp != hi:
        d_iq = d_iq[:, :hi].contiguous()
        d_w = d_w[:, :hi].contiguous()
    return loss, (d_iq, d_ik, d_w)


def _run_deterministic(iq, ik, w, idx, probs, g, logits_ws, lse, psum, lse_given, loss, d_iq, d_w, d_ik):
    """The loss program with gradients, d_index_k bitwise reproducible: chunks of rows (a contribution
    buffer of at most _DET_BUDGET_BYTES) store each valid slot's d_index_k row, the slots' order by
    index_k row is sorted on a side stream meanwhile, and the reduce adds each index_k row's
    contributions into ``d_ik`` [Tk, Di] fp32 in that order (chunk after chunk: a fixed order too)."""
    dev = iq.device
    t, kp = idx.shape
    tk, di = ik.shape
    target = _device_target(dev)
    prog = build_loss(di, True, target, det=True, lse_given=lse_given)
    red = build_reduce(di, 1, "float32", target=target)
    per_row = kp * di
    # int32 offsets inside the program: a chunk's contribution elements stay below 2**31
    chunk = chunk_rows(min(t, (2**31 - 1) // per_row), 4 * per_row, _DET_BUDGET_BYTES)
    contrib = torch.empty(chunk * kp, di, dtype=torch.float32, device=dev)
    no_exps = zeros_arg(1, torch.uint8, dev)
    for t0 in range(0, t, chunk):
        t1 = min(t, t0 + chunk)
        cb = contrib[: (t1 - t0) * kp]
        order_ready = slot_order_async(idx[t0:t1], tk, kp, 1)
        try:
            prog(iq[t0:t1], ik, w[t0:t1], idx[t0:t1], probs[t0:t1], g[t0:t1],
                 logits_ws if lse_given else logits_ws[t0:t1], lse[t0:t1] if lse_given else lse,
                 psum[t0:t1] if lse_given else psum, loss[t0:t1],
                 d_iq[t0:t1], d_w[t0:t1], cb)
        finally:
            rows, rowptr = order_ready()  # the side stream joins even when the launch raised
        red(cb, no_exps, rows, rowptr, d_ik, kp)


def _check_index_lse(index_lse, t, device):
    if index_lse is not None:
        _check("index_lse", index_lse, (torch.float32,), 1, device)
        if index_lse.shape[0] != t:
            raise ValueError(f"index_lse must be [T={t}] (one lse of the indexer logits per query row), "
                             f"got {tuple(index_lse.shape)}")


def _check_attention(index_q, index_k, q, kv, attn_lse, sink, scale) -> float:
    """Checks of the attention inputs of the target beside checked indexer inputs; returns scale as a float."""
    dev = index_q.device
    t, hi, di = index_q.shape
    _check("q", q, (torch.bfloat16,), 3, dev)
    _check("kv", kv, (torch.bfloat16,), 2, dev)
    h, dqk = q.shape[1], q.shape[2]
    tk = kv.shape[0]
    if index_k.shape[0] != tk:
        raise ValueError(f"index_k must be [Tk={tk}, Di={di}] like kv, got {tuple(index_k.shape)}")
    if q.shape[0] != t or kv.shape[1] != dqk:
        raise ValueError(f"q must be [T={t}, H, Dqk] and kv [Tk, Dqk], got {tuple(q.shape)} and {tuple(kv.shape)}")
    if attn_lse is not None:
        _check("attn_lse", attn_lse, (torch.float32,), 2, dev)
        if tuple(attn_lse.shape) != (t, h):
            raise ValueError(f"attn_lse must be [{t}, {h}], got {tuple(attn_lse.shape)}")
    if sink is not None:
        _check("sink", sink, (torch.float32,), 1, dev)
        if sink.shape[0] != h:
            raise ValueError(f"sink must be [{h}], got {tuple(sink.shape)}")
    reason = unsupported_reason(h, dqk, hi, di, q.dtype)
    if reason:
        raise ValueError(reason)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return scale


def indexer_kl_loss_sparse(index_q, index_k, weights, q, kv, attn_lse, topk_indices, scale: float, sink=None,
                           grad_rows=None, deterministic: bool = False, index_lse=None):
    """The standalone loss: the target recomputed from the attention inputs.

    index_q [T,Hi,Di] bf16, index_k [Tk,Di] bf16, weights [T,Hi] fp32, q [T,H,Dqk] bf16, kv [Tk,Dqk] bf16,
    attn_lse [T,H] fp32 or None (None: normaliser = logsumexp over the selected slots), topk_indices [T,k]
    int32 global rows (-1 / out of range = no slot), sink [H] fp32 or None (then normaliser =
    logaddexp(lse, sink)); grad_rows [T] fp32 (d objective / d loss row) or None (no gradients).
    Returns (loss_rows [T] fp32 = per-row KL(p || softmax_J(I)), and with grad_rows the gradients
    (d_index_q [T,Hi,Di] bf16, d_index_k [Tk,Di] fp32, d_weights [T,Hi] fp32), else None), where
    p[t,j] = sum_h exp(scale*<q[t,h],kv[idx_j]> - norm[t,h]) L1-normalised over valid slots.
    deterministic=True: d_index_k bitwise reproducible (per-slot rows summed in a fixed order, not fp32
    atomics); the other results are so in either mode. index_lse [T] fp32 or None: logsumexp of the indexer
    logits I over each row's valid slots (-inf for a row without one), as the indexer's forward saw them
    (``indexer_topk(..., return_lse=True)``); with gradients the loss program then skips its first pass."""
    _check_indexer(index_q, index_k, weights, topk_indices, grad_rows)
    dev = index_q.device
    _check_index_lse(index_lse, index_q.shape[0], dev)
    t, hi, di = index_q.shape
    scale = _check_attention(index_q, index_k, q, kv, attn_lse, sink, scale)
    h, tk = q.shape[1], kv.shape[0]
    idx, _, kp = _slots(topk_indices, tk)
    nhb = -(-h // BLOCK_H)
    if max(q.numel(), kv.numel(), t * kp * nhb) >= 2**31:
        raise ValueError("indexer_kl_loss_sparse: tensors of 2**31 or more elements are not supported (int32 offsets)")
    if t == 0 or tk == 0:
        return _run_loss(index_q, index_k, weights, idx, torch.zeros(t, kp, device=dev), grad_rows, deterministic)
    P = _attention_target(q, kv, attn_lse, sink, scale, idx)
    return _run_loss(index_q, index_k, weights, idx, P, grad_rows, deterministic, index_lse)


def _attention_target(q, kv, attn_lse, sink, scale, idx):
    """P [T, kp] fp32: the head sums of exp(scale <q, kv[slot]> - norm) over checked inputs, 0 on invalid slots;
    norm = attn_lse (logaddexp'ed with the sink), or with attn_lse None the log-sum-exp over the row's slots
    and the sink (the attn_probs program's lse pass). Slots: idx [T, kp] int32 slot lists (kp a multiple of
    SLOT_STEP, -1 = none)."""
    dev = q.device
    q, kv = aligned_operand(q), aligned_operand(kv)  # vector loads and TMA: aligned bases
    t, h, dqk = q.shape
    nhb = -(-h // BLOCK_H)
    lse_pass = attn_lse is None
    P = torch.empty(nhb, t, idx.shape[1], dtype=torch.float32, device=dev)
    no_sink = torch.full((h,), -math.inf, device=dev)
    if lse_pass:  # the program computes the normaliser, with the sink
        norm = torch.empty(t, h, dtype=torch.float32, device=dev)
        sink_t = sink.contiguous() if sink is not None else no_sink
    else:
        norm = (attn_lse if sink is None else torch.logaddexp(attn_lse, sink[None, :])).contiguous()
        sink_t = no_sink
    with torch.cuda.device(dev):
        build_attn_probs(dqk, lse_pass, _device_target(dev))(q, kv, idx, norm, sink_t, scale, P)
    return P[0] if nhb == 1 else P.sum(0)


def dense_target_heads(num_heads: int) -> int:
    """The query heads the tiled dense target runs with: ``num_heads`` padded up to one of DENSE_TARGET_HEADS
    (zero queries, norm +inf: they add nothing); above 128, groups of 128."""
    return next(n for n in DENSE_TARGET_HEADS if n >= min(num_heads, DENSE_TARGET_HEADS[-1]))


def _dense_target(plan, chunk, q, kv, attn_lse, sink, scale, width):
    """P [R, width] fp32 for the rows r0..r1 of an indexer plan's chunk (q [R, H, Dqk], attn_lse [R, H] or None
    of those rows), in the layout of the chunk's logits: column c of row r is key base[r] + c; only each row's
    window (plan.ks / plan.ke) holds its target. Given attn_lse the normaliser is it (logaddexp'ed with the
    sink); without it, the dense_norm program computes it over the same tiles first."""
    dev = q.device
    rows, h, dqk = q.shape
    qb0, qb1, _ = chunk
    r0 = qb0 * plan.bq
    hp = dense_target_heads(h)
    groups = -(-h // hp)
    if groups * hp != h:  # padded heads: zero queries (their normaliser is set to +inf below)
        q = torch.nn.functional.pad(q, (0, 0, 0, groups * hp - h))
    lo, hi = plan.blk_lo[qb0:qb1], plan.blk_hi[qb0:qb1]
    c = scale * _LOG2E
    heads = [slice(g * hp, (g + 1) * hp) for g in range(groups)]
    q_groups = [q[:, hs].contiguous().view(rows * hp, dqk) for hs in heads]  # one group: q itself, no copy
    with torch.cuda.device(dev):
        if attn_lse is None:  # the normaliser over each row's window, base 2, in the same tiles
            sink2 = torch.full((groups * hp,), -math.inf, device=dev)
            if sink is not None:
                sink2[:h] = sink * _LOG2E
            norm2 = torch.empty(rows, groups * hp, dtype=torch.float32, device=dev)
            kern = build_dense_norm(hp, dqk, plan.bq, plan.bk, _device_target(dev))
            ks, ke = plan.ks[r0:r0 + rows], plan.ke[r0:r0 + rows]
            for hs, qg in zip(heads, q_groups):
                out = norm2[:, hs].contiguous()  # one group: norm2 itself
                kern(qg, kv, ks, ke, lo, hi, sink2[hs], c, out.view(-1))
                if groups > 1:
                    norm2[:, hs] = out
        else:
            norm2 = (attn_lse if sink is None else torch.logaddexp(attn_lse, sink[None, :])) * _LOG2E
            if groups * hp != h:
                norm2 = torch.nn.functional.pad(norm2, (0, groups * hp - h))
        if groups * hp != h:
            norm2[:, h:] = math.inf  # padded heads add exp2(-inf) = 0
        P = torch.empty(rows, width, dtype=torch.float32, device=dev)
        kern = build_dense_target(hp, dqk, plan.bq, plan.bk, _device_target(dev))
        for g, (hs, qg) in enumerate(zip(heads, q_groups)):
            part = P if g == 0 else torch.empty_like(P)
            kern(qg, kv, norm2[:, hs].contiguous(), lo, hi, c, part)
            if g:
                P += part
    return P


def indexer_kl_loss_from_probs(index_q, index_k, weights, topk_indices, attn_probs, grad_rows=None,
                               deterministic: bool = False, index_lse=None):
    """The loss given its target (the fused path: the attention backward emits the target).

    index_q [T,Hi,Di] bf16, index_k [Tk,Di] bf16, weights [T,Hi] fp32, topk_indices [T,k] int32/int64
    global rows (-1 / out of range = no slot), attn_probs [T,k] fp32 (head sums of the attention
    probabilities of the slots, unnormalised), grad_rows [T] fp32 or None. Returns (loss_rows [T]
    fp32, and with grad_rows (d_index_q [T,Hi,Di] bf16, d_index_k [Tk,Di] fp32, d_weights [T,Hi]
    fp32), else None). deterministic=True: d_index_k bitwise reproducible and index_lse [T] fp32 (the
    first pass skipped) as in :func:`indexer_kl_loss_sparse`.
    """
    _check_indexer(index_q, index_k, weights, topk_indices, grad_rows)
    dev = index_q.device
    _check_index_lse(index_lse, index_q.shape[0], dev)
    t, hi, di = index_q.shape
    _check("attn_probs", attn_probs, (torch.float32,), 2, dev)
    if tuple(attn_probs.shape) != tuple(topk_indices.shape):
        raise ValueError(f"attn_probs must be [T={t}, k={topk_indices.shape[1]}] like topk_indices, "
                         f"got {tuple(attn_probs.shape)}")
    reason = unsupported_reason(64, 576, hi, di, index_q.dtype)  # no attention program runs
    if reason:
        raise ValueError(reason)
    idx, valid, kp = _slots(topk_indices, index_k.shape[0])
    k = topk_indices.shape[1]
    probs = torch.where(valid, attn_probs, 0.0)  # invalid slots carry nothing, whatever the caller passed
    if kp != k:
        probs = torch.nn.functional.pad(probs, (0, kp - k))
    return _run_loss(index_q, index_k, weights, idx, probs, grad_rows, deterministic, index_lse)


def dense_index_heads(index_heads: int) -> int:
    """The index heads the dense loss runs with: padded to a shipped score tiling (zero queries and weights
    add nothing)."""
    return 32 if index_heads <= 32 else 64


def dense_score_config(index_heads: int, index_dim: int) -> dict:
    """The indexer score tiling of the dense loss (its logits, score-gradient and dense programs follow it): the
    padded index heads (:func:`dense_index_heads`) and TileLang's own prefill tiling at any T (TILED_CONFIGS), so
    that short inputs run the shipped, warmed programs rather than the generation-step tiling."""
    from . import indexer as _indexer

    return _indexer.default_config(dense_index_heads(index_heads), index_dim, tiled=True)


#: Bytes of one fp32 [rows, width] buffer of a row chunk of the dense loss (the scores, the target, and a few
#: torch temporaries of that size live at once).
DENSE_CHUNK_BYTES = 128 << 20
#: Row chunks of the dense loss planned from the sizes alone (no host sync), not from the windows (a host sync,
#: fewer chunks under a causal mask). A module switch for A/B runs (benchmarks/kernels/profile_dense_loss.py).
DENSE_SYNC_FREE = True


def indexer_kl_loss_dense(index_q, index_k, weights, q, kv, attn_lse, key_start, key_end, scale: float, sink=None,
                          grad_rows=None, max_chunk_bytes: int | None = None):
    """The dense warm-up loss: every key of each row's window [key_start, key_end) is a slot.

    Blockwise, in chunks of rows whose fp32 [rows, width] buffers stay under ``max_chunk_bytes``
    (default DENSE_CHUNK_BYTES):
    the indexer's score program writes the logits I of the chunk (tiles of key blocks, as the
    indexer's forward), the dense_target program the target in the same tiles (after the dense_norm
    program's normaliser when attn_lse is None), the dense_terms program the row statistics, the loss rows and
    dI = g (softmax(I) - p) over I; then the score-gradient programs of :mod:`.indexer` give
    d_index_q and d_weights (query-major) and d_index_k (key-major, its splits added in order: no
    atomics, so every result is reproducible bit for bit). Never [T, T] at once.

    index_q [T,Hi,Di] bf16, index_k [Tk,Di] bf16, weights [T,Hi] float, q [T,H,Dqk] bf16, kv [Tk,Dqk]
    bf16, attn_lse [T,H] fp32 or None (None: normaliser = log-sum-exp over the window), key_start /
    key_end [T] int, sink [H] fp32 or None, grad_rows [T] fp32 or None. Returns (loss_rows [T] fp32,
    and with grad_rows (d_index_q [T,Hi,Di] bf16, d_index_k [Tk,Di] fp32, d_weights [T,Hi] fp32), else None).
    """
    from . import indexer as _indexer

    _check_indexer(index_q, index_k, weights, None, grad_rows, windows=(key_start, key_end))
    dev = index_q.device
    t, hi, di = index_q.shape
    scale = _check_attention(index_q, index_k, q, kv, attn_lse, sink, scale)
    tk = index_k.shape[0]
    if max(q.numel(), kv.numel(), t * hi * di) >= 2**31:
        raise ValueError("indexer_kl_loss_dense: tensors of 2**31 or more elements are not supported (int32 offsets)")
    hp = dense_index_heads(hi)
    iq, w, _ = _pad_heads(index_q, weights, hp)
    ik, q, kv = aligned_operand(index_k), aligned_operand(q), aligned_operand(kv)
    # windows clamped to the keys (int32 is then exact)
    ks = key_start.clamp(0, tk).to(torch.int32)
    ke = key_end.clamp(0, tk).to(torch.int32)
    loss = torch.zeros(t, dtype=torch.float32, device=dev)
    grads = None
    if grad_rows is not None:
        grads = (torch.zeros(t, hp, di, dtype=torch.bfloat16, device=dev),
                 torch.zeros(tk, di, dtype=torch.float32, device=dev),
                 torch.zeros(t, hp, dtype=torch.float32, device=dev))
    if t == 0 or tk == 0:
        return loss, None if grads is None else (grads[0][:, :hi], grads[1], grads[2][:, :hi])
    # chunks planned from the sizes alone (no host sync: the GPU's queue stays full, in training too)
    plan = _indexer._Plan(iq, ik, w, ks, ke, dense_score_config(hi, di),
                          DENSE_CHUNK_BYTES if max_chunk_bytes is None else max_chunk_bytes, sync_free=DENSE_SYNC_FREE)
    gcfg = _indexer.grad_config(plan.cfg)
    with torch.cuda.device(dev):
        for chunk in plan.chunks:
            r0, r1, scores = plan.chunk_scores(chunk)
            if scores is None:
                continue
            loss[r0:r1], d_scores = _dense_chunk_terms(plan, chunk, r0, r1, scores, q, kv, attn_lse, sink, scale,
                                                       None if grad_rows is None else grad_rows[r0:r1])
            del scores
            if grads is not None:
                _dense_chunk_grads(plan, gcfg, chunk, r0, r1, d_scores, iq, ik, w, grads)
    if grads is None:
        return loss, None
    d_iq, d_ik, d_w = grads
    return loss, ((d_iq[:, :hi].contiguous(), d_ik, d_w[:, :hi].contiguous()) if hp != hi else grads)


def _dense_chunk_terms(plan, chunk, r0, r1, scores, q, kv, attn_lse, sink, scale, grad_rows):
    """(loss rows [R], dI [R, W] (over the scores' buffer) or None) of rows r0..r1 of a plan's chunk from their
    score buffer [R, W] (column c is key base[row] + c)."""
    rows, width = scores.shape
    dev = scores.device
    ks, ke = plan.ks[r0:r1], plan.ke[r0:r1]
    probs = _dense_target(plan, chunk, q[r0:r1], kv, None if attn_lse is None else attn_lse[r0:r1].contiguous(),
                          sink, scale, width)
    loss_rows = torch.empty(rows, dtype=torch.float32, device=dev)
    grads = grad_rows is not None
    g = grad_rows.contiguous() if grads else zeros_arg(rows, torch.float32, dev)
    with torch.cuda.device(dev):
        build_dense_terms(grads, _device_target(dev))(scores, probs, ks, ke, g, loss_rows)
    return loss_rows, (scores if grads else None)


def _dense_chunk_grads(plan, gcfg, chunk, r0, r1, d_scores, iq, ik, w, grads):
    """Adds the gradients of rows r0..r1 (dI [R, W] in the score buffer's layout) into grads."""
    from . import indexer as _indexer

    d_iq, d_ik, d_w = grads
    dev = d_scores.device
    rows = r1 - r0
    hi, di = iq.shape[1], iq.shape[2]
    bq, bk = gcfg["block_q"], gcfg["block_k"]
    per_score_block = plan.bq // bq
    qb0, qb1, _ = chunk
    nqb = -(-rows // bq)
    # each gradient block of bq rows keeps its score block's key range (the DI columns start there)
    lo = plan.blk_lo[qb0:qb1].repeat_interleave(per_score_block)[:nqb].contiguous()
    hi_b = plan.blk_hi[qb0:qb1].repeat_interleave(per_score_block)[:nqb].contiguous()
    q_rows = plan.q[r0 * hi : r1 * hi]
    w_rows = w[r0:r1]
    _indexer.build_score_grads("query", gcfg)(q_rows, ik, w_rows, d_scores, lo, hi_b,
                                                      d_iq[r0:r1].view(rows * hi, di), d_w[r0:r1])
    # every key block (those no row of the chunk sees get an empty list): no host sync
    nkb = -(-d_ik.shape[0] // bk)
    ptr, ent, col = key_block_entries(lo, hi_b, max(1, chunk[2]), nkb)
    splits = max(1, min(32, -(-4 * _indexer._sm_count(dev) // nkb)))
    dk = torch.empty(splits, nkb * bk, di, dtype=torch.float32, device=dev)
    _indexer.build_score_grads("key", gcfg)(q_rows, ik, w_rows, d_scores, ptr, ent, col, dk)
    d_ik += dk.sum(0)[: d_ik.shape[0]]  # the splits in order: reproducible


def key_block_entries(lo: torch.Tensor, hi: torch.Tensor, width_blocks: int, n_key_blocks: int):
    """The key-major work list of the score-gradient program, without a host sync: lo/hi [nqb] int32, each
    query block's key blocks [lo, hi) (empty when hi <= lo; hi - lo <= width_blocks), key blocks
    0..n_key_blocks - 1. Returns (ptr [n_key_blocks + 1] int32, ent [nqb * width_blocks] int32, col [same]
    int32): key block kb is scored by the query blocks ent[ptr[kb]:ptr[kb + 1]] (ascending), kb - lo[ent]
    being its column block in their buffer; entries past ptr[-1] are padding."""
    dev = lo.device
    lo64 = lo.long()
    key_block = lo64[:, None] + torch.arange(width_blocks, device=dev)[None, :]
    key_block = torch.where(key_block < hi.long()[:, None], key_block, n_key_blocks).reshape(-1)  # padding last
    key_block, order = torch.sort(key_block, stable=True)
    owner = torch.div(order, width_blocks, rounding_mode="floor")
    ptr = torch.searchsorted(key_block, torch.arange(n_key_blocks + 1, device=dev)).to(torch.int32)
    col = torch.where(key_block < n_key_blocks, key_block - lo64[owner], 0).to(torch.int32)
    return ptr, owner.to(torch.int32), col
