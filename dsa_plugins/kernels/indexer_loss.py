"""Sparse indexer KL loss (DeepSeek-V3.2 sparse stage, DSA.md 1.2): TileLang kernels for Hopper.

For query row t and its selected slots j (topk_indices[t, j], valid when 0 <= idx < Tk):

    p[t, j]  = sum_h exp(scale * <q[t,h], kv[idx_j]> - norm[t,h])   then L1-normalised over valid j
    I[t, j]  = sum_h relu(<index_q[t,h], index_k[idx_j]>) * weights[t,h]
    loss[t]  = sum_j p[t,j] * (log p[t,j] - log_softmax_j(I[t])[j])     (0 for rows without a slot)

norm = attn_lse (logaddexp'ed with the sink when one is given), or, with attn_lse None, the
log-sum-exp of the scores over the selected slots (logaddexp'ed with the sink).

Design (three programs, one CTA per query row; k is padded with -1 to a multiple of 64):

- ``attn_probs``: grid (T, ceil(H / 64)), one warpgroup. The 64 query heads of the CTA stay in
  shared memory; per block of slots the kv rows are gathered with predicated cp.async (an invalid
  or out-of-range index is never dereferenced: the copy is predicated off and the slot masked).
  block_k 32 (default): S = Q [64, Dqk] x KV_blk^T on wgmma, the head sum is a cross-warp
  reduction; 110 KB of shared memory, two CTAs per SM. block_k 64: S^T = KV_blk x Q^T (slots as
  MMA rows, head sum inside a thread quad) but 144 KB, one CTA per SM, and slower.
  p_blk[j] = sum_h exp(S - norm_h) is written to an fp32 workspace [ceil(H/64), T, k]. With
  ``lse_pass`` (attn_lse None) a first sweep computes the per-head log-sum-exp online (a second
  gather of every kv row). ``fuse_logits`` (block_k 64, H <= 64) computes the indexer logits in
  the same loop instead of the separate program.
- ``indexer_logits``: grid (T), one warpgroup: gathers the index_k rows of each slot block,
  L^T = IK_blk [64, Di] x IQ^T [Di, Hi] on wgmma, relu, weighted head sum -> I workspace [T, k]
  (-inf for invalid slots).
- The row reductions (sum of p, log-sum-exp of I, the KL of the row, and in the backward
  dI = g * (softmax(I) - p)) are elementwise torch work on the [T, k] workspaces.
- ``indexer_bwd``: grid (T), one warpgroup: recomputes L^T per slot block, accumulates
  d_index_q [Hi, Di] (wgmma, dL^T^T x IK_blk) and d_weights (sum_j dI_j relu(L_jh)) in
  registers, and scatter-adds d_index_k rows (dL^T x IQ) with fp32 atomics (red.v2.f32 from the
  fragment, or with ``dk_x4`` red.v4.f32 through shared memory) into a zeroed buffer. The
  backward never touches q or kv.

Measured on an H200 (T 8192, k 2048 causal top-k, H 64, Dqk 576, Hi 64, Di 128, bf16, median of
10): forward + backward 13.4 ms with the default (attn_probs 6.05 ms = 204 TFLOP/s on the QK
GEMM, indexer_logits 1.23 ms, torch row reductions ~0.7 ms, backward 5.45 ms); forward with
attn_lse None 12.7 ms. block_k 64: 17.5 ms (attn_probs 10.1 ms); fuse_logits 17.4 ms; dk_x4 no
gain (backward 5.75 ms). The 2.5 ms goal (2x the indexer forward) is not reached: the kv gather is
overlapped with the MMA only across CTAs (num_stages 2 does not lower in TileLang 0.1.15 with this
gather), and the backward (not broken down; suspected bound: 2.1 G fp32 atomic adds into
d_index_k) alone takes 5.45 ms.

Index heads (at most 64) are padded to 64 by the wrapper (zero queries, zero weights); query heads
below 64 are padded inside the kernel (zero rows with norm = +inf, so they contribute nothing).

TileLang is imported lazily so that this module imports without TileLang or a GPU.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations

import math
import threading

import torch

from .._config import logger

__all__ = [
    "DEFAULT_CONFIG",
    "SHIPPED_CONFIGS",
    "build_all",
    "build_attn_probs",
    "build_config",
    "build_indexer_bwd",
    "build_indexer_logits",
    "indexer_kl_loss_sparse",
    "indexer_kl_loss_sparse_backward",
    "unsupported_reason",
]

_LOG2E = 1.4426950408889634
BLOCK_K = 64  # slots per block in every program
BLOCK_H = 64  # query heads per attention CTA

#: Run-time knobs shared by the three programs (compile-time parameters besides the dims).
#: block_k 32 (heads as MMA rows, two CTAs per SM) measured fastest; block_k 64, fuse_logits and
#: dk_x4 are GPU-tested alternatives (see the module docstring for the figures).
DEFAULT_CONFIG: dict = {"num_stages": 1, "threads": 128, "block_k": 32, "fuse_logits": False, "index_dim": 128,
                        "dk_x4": False}

#: Every configuration the package ships: (kind, compile parameters). T, Tk, k and H are
#: run-time sizes; H 16/32/64/128 share the attention programs, Hi <= 64 the indexer programs.
SHIPPED_CONFIGS: list = [
    {"kind": "attn_probs", "dim": 576, "lse_pass": False, **DEFAULT_CONFIG},
    {"kind": "attn_probs", "dim": 576, "lse_pass": True, **DEFAULT_CONFIG},
    {"kind": "attn_probs", "dim": 512, "lse_pass": False, **DEFAULT_CONFIG},
    {"kind": "attn_probs", "dim": 512, "lse_pass": True, **DEFAULT_CONFIG},
    {"kind": "indexer_logits", "heads": 64, "dim": 128, **DEFAULT_CONFIG},
    {"kind": "indexer_bwd", "heads": 64, "dim": 128, **DEFAULT_CONFIG},
]

_KEYS = {
    "attn_probs": ("dim", "lse_pass", "block_k", "num_stages", "threads", "fuse_logits", "index_dim"),
    "indexer_logits": ("heads", "dim", "num_stages", "threads"),
    "indexer_bwd": ("heads", "dim", "num_stages", "threads", "dk_x4"),
}


# ----------------------------------------------------------------------------- programs
def _attn_probs_program(dim: int, lse_pass: bool, block_k: int, num_stages: int, threads: int,
                        fuse_logits: bool = False, index_heads: int = 64, index_dim: int = 128):
    import tilelang.language as T

    BK, HB, D = block_k, BLOCK_H, dim
    HI, DI = index_heads, index_dim
    dtype, acc = "bfloat16", "float32"
    NT, TK, KP, H, NHB = T.dynamic("n_rows, n_keys, topk_padded, heads, head_blocks")
    neg_big = -1.0e30
    slots_as_rows = BK == 64
    if fuse_logits and not slots_as_rows:
        raise ValueError("fuse_logits needs block_k 64")

    @T.macro
    def prologue(Q, Norm, Sink, KV, Idx, bx, by, c, q_s, kv_s, norm_s):
        # q rows of the head block (zeros past H), then the per-head normaliser (base 2) in norm_s
        h0 = by * HB
        for h, d in T.Parallel(HB, D):
            q_s[h, d] = T.if_then_else(h0 + h < H, Q[bx, T.min(h0 + h, H - 1), d], T.cast(0, dtype))
        if lse_pass:
            s = T.alloc_fragment([HB, BK], acc)  # heads x slots
            m_i = T.alloc_fragment([HB], acc)
            l_i = T.alloc_fragment([HB], acc)
            m_new = T.alloc_fragment([HB], acc)
            rs = T.alloc_fragment([HB], acc)
            T.fill(m_i, neg_big)
            T.fill(l_i, 0)
            for i in T.Pipelined(KP // BK, num_stages=num_stages):
                for j, d in T.Parallel(BK, D):
                    kv_s[j, d] = KV[T.if_then_else((Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                                                   Idx[bx, i * BK + j], 0), d]
                T.gemm(q_s, kv_s, s, transpose_B=True, clear_accum=True)
                for h, j in T.Parallel(HB, BK):
                    s[h, j] = T.if_then_else(
                        (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK), s[h, j] * c, -T.infinity(acc))
                T.reduce_max(s, m_new, dim=1, clear=True)
                for h in T.Parallel(HB):
                    m_new[h] = T.max(m_new[h], m_i[h])
                for h, j in T.Parallel(HB, BK):
                    s[h, j] = T.exp2(s[h, j] - m_new[h])
                T.reduce_sum(s, rs, dim=1)
                for h in T.Parallel(HB):
                    l_i[h] = l_i[h] * T.exp2(m_i[h] - m_new[h]) + rs[h]
                    m_i[h] = m_new[h]
            # norm (base 2) = log2(exp2(lse2) + exp2(sink2)); +inf for padded heads
            for h in T.Parallel(HB):
                sk = Sink[T.min(h0 + h, H - 1)] * _LOG2E
                lse2 = T.if_then_else(l_i[h] > 0, m_i[h] + T.log2(T.max(l_i[h], 1e-30)), -T.infinity(acc))
                mx = T.max(lse2, sk)
                nrm = T.if_then_else(
                    mx > -T.infinity(acc), mx + T.log2(T.exp2(lse2 - mx) + T.exp2(sk - mx)), -T.infinity(acc))
                norm_s[h] = T.if_then_else(h0 + h < H, nrm, T.infinity(acc))
        else:
            for h in T.Parallel(HB):
                norm_s[h] = T.if_then_else(h0 + h < H, Norm[bx, T.min(h0 + h, H - 1)] * _LOG2E, T.infinity(acc))

    @T.macro
    def probs_block(KV, Idx, P, bx, by, i, c, q_s, kv_s, norm_s, st, sh, pj):
        for j, d in T.Parallel(BK, D):
            kv_s[j, d] = KV[T.if_then_else((Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                                           Idx[bx, i * BK + j], 0), d]
        if slots_as_rows:
            # S^T [slots, heads]: the head sum stays inside a thread quad
            T.gemm(kv_s, q_s, st, transpose_B=True, clear_accum=True)
            for j, h in T.Parallel(BK, HB):
                st[j, h] = T.if_then_else(
                    (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                    T.exp2(st[j, h] * c - norm_s[h]), 0.0)
            T.reduce_sum(st, pj, dim=1, clear=True)
        else:
            # S [heads, slots] (32 slots: half the shared memory, two CTAs per SM)
            T.gemm(q_s, kv_s, sh, transpose_B=True, clear_accum=True)
            for h, j in T.Parallel(HB, BK):
                sh[h, j] = T.if_then_else(
                    (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                    T.exp2(sh[h, j] * c - norm_s[h]), 0.0)
            T.reduce_sum(sh, pj, dim=0, clear=True)
        for j in T.Parallel(BK):
            P[by, bx, i * BK + j] = pj[j]

    # the prim_funcs are built when defined: define only the one asked for
    if fuse_logits:
        @T.prim_func
        def main_fused(
            Q: T.Tensor([NT, H, D], dtype),
            KV: T.Tensor([TK, D], dtype),
            Idx: T.Tensor([NT, KP], "int32"),
            Norm: T.Tensor([NT, H], acc),
            Sink: T.Tensor([H], acc),
            scale: T.float32,
            P: T.Tensor([NHB, NT, KP], acc),
            IQ: T.Tensor([NT, HI, DI], dtype),
            IK: T.Tensor([TK, DI], dtype),
            W: T.Tensor([NT, HI], acc),
            I: T.Tensor([NT, KP], acc),
        ):
            # one head block only (H <= 64): the indexer logits of the same slots ride along
            with T.Kernel(NT, NHB, threads=threads) as (bx, by):
                q_s = T.alloc_shared([HB, D], dtype)
                kv_s = T.alloc_shared([BK, D], dtype)
                norm_s = T.alloc_shared([HB], acc)
                iq_s = T.alloc_shared([HI, DI], dtype)
                ik_s = T.alloc_shared([BK, DI], dtype)
                w_s = T.alloc_shared([HI], acc)
                st = T.alloc_fragment([BK, HB], acc)
                pj = T.alloc_fragment([BK], acc)
                lt = T.alloc_fragment([BK, HI], acc)
                red = T.alloc_fragment([BK], acc)
                c = scale * _LOG2E
                T.copy(IQ[bx, :, :], iq_s)
                for h in T.Parallel(HI):
                    w_s[h] = W[bx, h]
                prologue(Q, Norm, Sink, KV, Idx, bx, by, c, q_s, kv_s, norm_s)
                for i in T.Pipelined(KP // BK, num_stages=num_stages):
                    for j, d in T.Parallel(BK, DI):
                        ik_s[j, d] = IK[T.if_then_else((Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                                                       Idx[bx, i * BK + j], 0), d]
                    probs_block(KV, Idx, P, bx, by, i, c, q_s, kv_s, norm_s, st, None, pj)
                    T.gemm(ik_s, iq_s, lt, transpose_B=True, clear_accum=True)
                    for j, h in T.Parallel(BK, HI):
                        lt[j, h] = T.max(lt[j, h], 0.0) * w_s[h]
                    T.reduce_sum(lt, red, dim=1, clear=True)
                    for j in T.Parallel(BK):
                        I[bx, i * BK + j] = T.if_then_else(
                            (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK), red[j], -T.infinity(acc))

        return main_fused

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
            st = T.alloc_fragment([BK, HB], acc) if slots_as_rows else None  # slots x heads
            sh = None if slots_as_rows else T.alloc_fragment([HB, BK], acc)  # heads x slots
            pj = T.alloc_fragment([BK], acc)
            c = scale * _LOG2E
            prologue(Q, Norm, Sink, KV, Idx, bx, by, c, q_s, kv_s, norm_s)
            for i in T.Pipelined(KP // BK, num_stages=num_stages):
                probs_block(KV, Idx, P, bx, by, i, c, q_s, kv_s, norm_s, st, sh, pj)

    return main


def _indexer_logits_program(heads: int, dim: int, num_stages: int, threads: int):
    import tilelang.language as T

    BK, HI, D = BLOCK_K, heads, dim
    dtype, acc = "bfloat16", "float32"
    NT, TK, KP = T.dynamic("n_rows, n_keys, topk_padded")

    @T.prim_func
    def main(
        IQ: T.Tensor([NT, HI, D], dtype),
        IK: T.Tensor([TK, D], dtype),
        W: T.Tensor([NT, HI], acc),
        Idx: T.Tensor([NT, KP], "int32"),
        I: T.Tensor([NT, KP], acc),
    ):
        with T.Kernel(NT, threads=threads) as bx:
            iq_s = T.alloc_shared([HI, D], dtype)
            ik_s = T.alloc_shared([BK, D], dtype)
            w_s = T.alloc_shared([HI], acc)
            o_s = T.alloc_shared([BK], acc)
            lt = T.alloc_fragment([BK, HI], acc)
            red = T.alloc_fragment([BK], acc)
            T.copy(IQ[bx, :, :], iq_s)
            for h in T.Parallel(HI):
                w_s[h] = W[bx, h]
            for i in T.Pipelined(KP // BK, num_stages=num_stages):
                for j, d in T.Parallel(BK, D):
                    ik_s[j, d] = IK[T.if_then_else((Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                                                   Idx[bx, i * BK + j], 0), d]
                T.gemm(ik_s, iq_s, lt, transpose_B=True, clear_accum=True)
                for j, h in T.Parallel(BK, HI):
                    lt[j, h] = T.max(lt[j, h], 0.0) * w_s[h]
                T.reduce_sum(lt, red, dim=1, clear=True)
                for j in T.Parallel(BK):
                    o_s[j] = T.if_then_else(
                        (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK), red[j], -T.infinity(acc))
                T.copy(o_s, I[bx, i * BK:(i + 1) * BK])

    return main


def _indexer_bwd_program(heads: int, dim: int, num_stages: int, threads: int, dk_x4: bool = False):
    import tilelang.language as T

    BK, HI, D = BLOCK_K, heads, dim
    dtype, acc = "bfloat16", "float32"
    NT, TK, KP = T.dynamic("n_rows, n_keys, topk_padded")

    @T.prim_func
    def main(
        IQ: T.Tensor([NT, HI, D], dtype),
        IK: T.Tensor([TK, D], dtype),
        W: T.Tensor([NT, HI], acc),
        Idx: T.Tensor([NT, KP], "int32"),
        DI: T.Tensor([NT, KP], acc),
        DIQ: T.Tensor([NT, HI, D], dtype),
        DW: T.Tensor([NT, HI], acc),
        DK: T.Tensor([TK, D], acc),
    ):
        with T.Kernel(NT, threads=threads) as bx:
            iq_s = T.alloc_shared([HI, D], dtype)
            ik_s = T.alloc_shared([BK, D], dtype)
            dl_s = T.alloc_shared([BK, HI], dtype)
            w_s = T.alloc_shared([HI], acc)
            d_s = T.alloc_shared([BK], acc)
            g_s = T.alloc_shared([BK, HI], acc)
            lt = T.alloc_fragment([BK, HI], acc)
            gacc = T.alloc_fragment([BK, HI], acc)  # sum over blocks of dI_j * relu(L_jh)
            acc_q = T.alloc_fragment([HI, D], acc)
            acc_k = T.alloc_fragment([BK, D], acc)
            gt = T.alloc_fragment([HI, BK], acc)
            dw_f = T.alloc_fragment([HI], acc)
            dk_s = T.alloc_shared([BK, D], acc) if dk_x4 else None
            T.copy(IQ[bx, :, :], iq_s)
            for h in T.Parallel(HI):
                w_s[h] = W[bx, h]
            T.fill(acc_q, 0)
            T.fill(gacc, 0)
            for i in T.Pipelined(KP // BK, num_stages=num_stages):
                for j, d in T.Parallel(BK, D):
                    ik_s[j, d] = IK[T.if_then_else((Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK),
                                                   Idx[bx, i * BK + j], 0), d]
                for j in T.Parallel(BK):
                    d_s[j] = T.if_then_else(
                        (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK), DI[bx, i * BK + j], 0.0)
                T.gemm(ik_s, iq_s, lt, transpose_B=True, clear_accum=True)
                for j, h in T.Parallel(BK, HI):
                    gacc[j, h] += d_s[j] * T.max(lt[j, h], 0.0)
                    dl_s[j, h] = T.cast(T.if_then_else(lt[j, h] > 0, d_s[j] * w_s[h], 0.0), dtype)
                T.gemm(dl_s, ik_s, acc_q, transpose_A=True)
                T.gemm(dl_s, iq_s, acc_k, clear_accum=True)
                if dk_x4:
                    # through shared memory, then one 16-byte atomic (red.v4.f32) per 4 columns
                    T.copy(acc_k, dk_s)
                    for j, d4 in T.Parallel(BK, D // 4):
                        if (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK):
                            T.atomic_addx4(DK[Idx[bx, i * BK + j], d4 * 4], dk_s[j, d4 * 4])
                else:
                    for j, d in T.Parallel(BK, D):
                        if (Idx[bx, i * BK + j] >= 0) and (Idx[bx, i * BK + j] < TK):
                            T.atomic_add(DK[Idx[bx, i * BK + j], d], acc_k[j, d])
            T.copy(gacc, g_s)
            for h, j in T.Parallel(HI, BK):
                gt[h, j] = g_s[j, h]
            T.reduce_sum(gt, dw_f, dim=1, clear=True)
            for h in T.Parallel(HI):
                DW[bx, h] = dw_f[h]
            for h, d in T.Parallel(HI, D):
                DIQ[bx, h, d] = T.cast(acc_q[h, d], dtype)

    return main


_PROGRAMS = {
    "attn_probs": _attn_probs_program,
    "indexer_logits": _indexer_logits_program,
    "indexer_bwd": _indexer_bwd_program,
}


# ----------------------------------------------------------------------------- building
def _normalise(config: dict) -> tuple:
    kind = config.get("kind")
    if kind not in _KEYS:
        raise ValueError(f"config kind must be one of {sorted(_KEYS)}, got {kind!r}")
    cfg = {**DEFAULT_CONFIG, **config}
    out = []
    for k in _KEYS[kind]:
        if k not in cfg:
            raise ValueError(f"{kind} config needs {k!r}")
        out.append((k, bool(cfg[k]) if k in ("lse_pass", "fuse_logits", "dk_x4") else int(cfg[k])))
    params = dict(out)
    if params["dim"] % 16 != 0 or not 16 <= params["dim"] <= 1024:
        raise ValueError(f"dim must be a multiple of 16 in [16, 1024], got {params['dim']}")
    if "block_k" in params and params["block_k"] not in (32, 64):
        raise ValueError(f"attn_probs block_k must be 32 or 64, got {params['block_k']}")
    if params.get("fuse_logits") and params["block_k"] != 64:
        raise ValueError("attn_probs fuse_logits needs block_k 64")
    if not params.get("fuse_logits", True):
        params["index_dim"] = 128  # unused by the unfused program: one cache key
        out = [(k, params[k]) for k, _ in out]
    if "heads" in params and params["heads"] != 64:
        raise ValueError(f"indexer heads are padded to 64, got {params['heads']}")
    return (kind,) + tuple(out)


def _target_key(target) -> str:
    if isinstance(target, dict):
        return ",".join(f"{k}={target[k]}" for k in sorted(target))
    return str(target)


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
    tkey = _target_key(target)
    kern = _BUILT.get((key, tkey))
    if kern is not None:
        return kern
    kind, params = key[0], dict(key[1:])
    with _BUILD_LOCK:  # TIR construction is not thread-safe; nvcc below runs in parallel
        kern = _BUILT.get((key, tkey))
        if kern is not None:
            return kern
        func = _PROGRAMS[kind](**params)
    kern = tilelang.compile(
        func, target=target, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
        compile_flags=["-O3", "-DNDEBUG"],
    )
    logger.info("compiled TileLang indexer_loss %s %s target=%s", kind, params, tkey)
    with _BUILD_LOCK:
        return _BUILT.setdefault((key, tkey), kern)


def build_attn_probs(config: dict, target="auto"):
    """Compile the attention-probability program of ``config`` (kind "attn_probs")."""
    return _build({**config, "kind": "attn_probs"}, target)


def build_indexer_logits(config: dict, target="auto"):
    """Compile the sparse indexer-logit program of ``config`` (kind "indexer_logits")."""
    return _build({**config, "kind": "indexer_logits"}, target)


def build_indexer_bwd(config: dict, target="auto"):
    """Compile the indexer backward program of ``config`` (kind "indexer_bwd")."""
    return _build({**config, "kind": "indexer_bwd"}, target)


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


class _Ctx:
    """What the backward needs: padded indexer inputs, the slots, and the row statistics."""

    __slots__ = ("I", "P", "config", "hi", "idx", "ik", "iq", "lse_i", "psum", "shape", "target", "w")


def _pad_heads(index_q, weights):
    hi = index_q.shape[1]
    hp = 64
    iq = index_q.contiguous()
    w = weights.float().contiguous()
    if hp != hi:
        iq = torch.nn.functional.pad(iq, (0, 0, 0, hp - hi))
        w = torch.nn.functional.pad(w, (0, hp - hi))
    return iq, w, hp


def indexer_kl_loss_sparse(index_q, index_k, weights, q, kv, attn_lse, topk_indices, scale: float, sink=None,
                           config: dict | None = None):
    """index_q [T,Hi,Di] bf16, index_k [Tk,Di] bf16, weights [T,Hi] fp32, q [T,H,Dqk] bf16, kv [Tk,Dqk] bf16,
    attn_lse [T,H] fp32 or None (None: normaliser = logsumexp over the selected slots), topk_indices [T,k] int32
    global rows (-1 / out of range = no slot), sink [H] fp32 or None (then normaliser = logaddexp(lse, sink)).
    Returns (loss_rows [T] fp32 = per-row KL(p || softmax_J(I)), and a context for the backward), where
    p[t,j] = sum_h exp(scale*<q[t,h],kv[idx_j]> - norm[t,h]) L1-normalised over valid slots.

    ``config`` overrides DEFAULT_CONFIG (num_stages, threads) for tests and tuning."""
    _check("index_q", index_q, (torch.bfloat16,), 3)
    dev = index_q.device
    t, hi, di = index_q.shape
    _check("index_k", index_k, (torch.bfloat16,), 2, dev)
    _check("weights", weights, (torch.float32, torch.bfloat16, torch.float16), 2, dev)
    _check("q", q, (torch.bfloat16,), 3, dev)
    _check("kv", kv, (torch.bfloat16,), 2, dev)
    _check("topk_indices", topk_indices, (torch.int32, torch.int64), 2, dev)
    h, dqk = q.shape[1], q.shape[2]
    tk = kv.shape[0]
    if index_k.shape != (tk, di):
        raise ValueError(f"index_k must be [Tk={tk}, Di={di}], got {tuple(index_k.shape)}")
    if tuple(weights.shape) != (t, hi):
        raise ValueError(f"weights must be [{t}, {hi}], got {tuple(weights.shape)}")
    if q.shape[0] != t or kv.shape[1] != dqk:
        raise ValueError(f"q must be [T={t}, H, Dqk] and kv [Tk, Dqk], got {tuple(q.shape)} and {tuple(kv.shape)}")
    if topk_indices.shape[0] != t:
        raise ValueError(f"topk_indices must be [T={t}, k], got {tuple(topk_indices.shape)}")
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
    cfg = {**DEFAULT_CONFIG, **(config or {})}

    k = topk_indices.shape[1]
    kp = max(1, -(-k // BLOCK_K)) * BLOCK_K
    idx = topk_indices.to(torch.int32)
    idx = torch.where((idx >= 0) & (idx < tk), idx, -1)
    if kp != k:
        idx = torch.nn.functional.pad(idx, (0, kp - k), value=-1)
    idx = idx.contiguous()
    if max(q.numel(), kv.numel(), t * kp * max(1, -(-h // BLOCK_H)), t * 128 * di) >= 2**31:
        raise ValueError("indexer_kl_loss_sparse: tensors of 2**31 or more elements are not supported (int32 offsets)")
    iq, w, hp = _pad_heads(index_q, weights)

    ctx = _Ctx()
    ctx.hi, ctx.shape, ctx.config = hi, (t, hi, di, tk, k), cfg
    if t == 0 or tk == 0:
        zeros = torch.zeros(t, kp, dtype=torch.float32, device=dev)
        ctx.iq, ctx.ik, ctx.w, ctx.idx = iq, index_k, w, idx
        ctx.I, ctx.P = zeros.fill_(-math.inf), torch.zeros_like(zeros)
        ctx.psum = torch.zeros(t, dtype=torch.float32, device=dev)
        ctx.lse_i = torch.full((t,), -math.inf, dtype=torch.float32, device=dev)
        ctx.target = None
        return torch.zeros(t, dtype=torch.float32, device=dev), ctx

    target = _device_target(dev)
    nhb = -(-h // BLOCK_H)
    qc, kvc, ikc = q.contiguous(), kv.contiguous(), index_k.contiguous()
    lse_pass = attn_lse is None
    if lse_pass:
        norm = torch.empty(t, h, dtype=torch.float32, device=dev)  # unused by the program
        sink_t = sink.contiguous() if sink is not None else torch.full((h,), -math.inf, device=dev)
    else:
        norm = attn_lse if sink is None else torch.logaddexp(attn_lse, sink[None, :])
        norm = norm.contiguous()
        sink_t = torch.full((h,), -math.inf, device=dev)
    P = torch.empty(nhb, t, kp, dtype=torch.float32, device=dev)
    I = torch.empty(t, kp, dtype=torch.float32, device=dev)
    fused = bool(cfg.get("fuse_logits")) and nhb == 1
    acfg = {**cfg, "dim": dqk, "lse_pass": lse_pass, "fuse_logits": fused, "index_dim": di}
    with torch.cuda.device(dev):
        if fused:  # one head block: the indexer logits ride along with the attention probabilities
            build_attn_probs(acfg, target)(qc, kvc, idx, norm, sink_t, scale, P, iq, ikc, w, I)
        else:
            build_attn_probs({**acfg, "index_dim": 128}, target)(qc, kvc, idx, norm, sink_t, scale, P)
            build_indexer_logits({**cfg, "heads": hp, "dim": di}, target)(iq, ikc, w, idx, I)
    P = P[0] if nhb == 1 else P.sum(0)

    # row reductions (elementwise torch work on [T, k])
    psum = P.sum(1)
    lse_i = torch.logsumexp(I, dim=1)  # -inf for rows without a slot
    pos = P > 0
    pn = P / psum.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    logq = I - lse_i[:, None]
    term = torch.where(pos, pn * (torch.log(pn.clamp_min(torch.finfo(torch.float32).tiny)) - logq), 0.0)
    loss = torch.where(psum > 0, term.sum(1), 0.0)

    ctx.iq, ctx.ik, ctx.w, ctx.idx = iq, ikc, w, idx
    ctx.I, ctx.P, ctx.psum, ctx.lse_i, ctx.target = I, P, psum, lse_i, target
    return loss, ctx


def indexer_kl_loss_sparse_backward(ctx, grad_rows):
    """grad_rows [T] fp32 = dLoss/dloss_rows. dL/dI[t,j] = grad_rows[t] * (softmax_J(I)[t,j] - p[t,j]);
    then through I = sum_h relu(<iq_h, ik_j>) w_h. d_index_k is scatter-added (zero-initialise before atomics).

    Returns (d_index_q [T,Hi,Di] bf16, d_index_k [Tk,Di] fp32, d_weights [T,Hi] fp32)."""
    t, hi, di, tk, _ = ctx.shape
    dev = ctx.iq.device
    hp = ctx.iq.shape[1]
    d_ik = torch.zeros(tk, di, dtype=torch.float32, device=dev)
    if t == 0 or tk == 0 or ctx.target is None:
        return (torch.zeros(t, hi, di, dtype=torch.bfloat16, device=dev), d_ik,
                torch.zeros(t, hi, dtype=torch.float32, device=dev))
    g = grad_rows.to(device=dev, dtype=torch.float32).reshape(t)
    valid = ctx.I > -math.inf
    has = ctx.lse_i > -math.inf
    soft = torch.where(valid & has[:, None], torch.exp(ctx.I - ctx.lse_i.where(has, 0.0)[:, None]), 0.0)
    pn = ctx.P / ctx.psum.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
    d_i = torch.where(valid, (soft - pn) * g[:, None], 0.0).contiguous()
    d_iq = torch.empty(t, hp, di, dtype=torch.bfloat16, device=dev)
    d_w = torch.empty(t, hp, dtype=torch.float32, device=dev)
    with torch.cuda.device(dev):
        build_indexer_bwd({"heads": hp, "dim": di, **ctx.config}, ctx.target)(
            ctx.iq, ctx.ik, ctx.w, ctx.idx, d_i, d_iq, d_w, d_ik)
    if hp != hi:
        d_iq = d_iq[:, :hi].contiguous()
        d_w = d_w[:, :hi].contiguous()
    return d_iq, d_ik, d_w
