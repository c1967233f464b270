"""Sparse attention forward over a shared latent (DSA), one TileLang kernel family for Hopper.

    q [B, S, H, Dqk], kv [B, Skv, Dqk], indices [B, S, K] int32, optional sink [H] fp32
    s_hj = scale * <q_h, kv[idx_j]>   (valid j only: 0 <= idx_j < Skv; others are never loaded)
    out  = softmax_j(s) @ kv[idx, :Dv]  (times exp(lse) / (exp(lse) + exp(z_h)) with a sink)
    lse  = log sum_j exp(s_hj)          (natural log, sink excluded; +inf and out = 0 for empty rows)

Design (one CTA per (64-head block, query token, batch), 3 warpgroups, 384 threads):

- Producer warpgroup: gathers the 64 kv rows a block of indices names into shared memory with
  predicated cp.async (16 bytes per copy, 8 threads per row), double buffered with mbarriers; the
  indices of the next block are fetched while the current one lands. An invalid index is never
  dereferenced: its copy is predicated off (cp.async zero-fills the row) and the slot is flagged.
- Two consumer warpgroups, each owning one column half of the output (64 heads x Dv/2, fp32 in
  registers). Schedules (compile-time parameter ``schedule``):
  "seesaw" (the default: prefill, and generation steps whose rows are left whole): the producer
  loads each stage in halves (value columns left / right, each with its own barriers); consumer 0
  scores the even slot blocks and consumer 1 the odd ones, the running row maximum passes between
  them, each keeps its own P in registers for its output half and hands it to the other through
  shared memory; consumer 0 issues the next block's score MMAs behind its last P @ V, and a
  half-stage read by one consumer only is freed as soon as that consumer's P @ V is done. Compiled
  without TileLang's automatic warpgroup syncs (``auto_sync``): its own barriers order its shared
  memory.
  "qk_one" (the programs that cut a generation step's rows into parts): consumer 0 computes all
  scores of the block (64 heads x 64 slots over Dqk), runs the online softmax, hands P (bf16) and
  the rescale factors to consumer 1 through shared memory and named barriers, then both accumulate
  P @ V for their half.
  "split": consumer g computes the scores of slot half g (64 x 32), the two exchange row maxima
  through shared memory, each writes its half of P, and each accumulates its output half from
  both halves of P (balanced, but the 64x32 score MMAs are shared-memory bound).
  The softmax runs in fp32 with exp2 and the scale folded in; lse is converted to natural log.
- Q comes in by TMA (one thread issues it on an mbarrier) and each consumer's output half leaves by TMA
  stores from shared memory, one 64-column tile at a time as it is converted (``tma_io``), so the SM's
  load/store pipe carries only the gathers. Rows with ``skip_tail`` stop at their last valid slot; their
  block counts come from one launch before the kernel (``row_scan.row_blocks_cuda``).
- Head counts below 64 (16, 32: tensor-parallel shards) are padded inside the kernel: padding
  rows read zeros (outside the TMA tensor's bounds), give finite values and are never written.

B, S, H, Skv and the padded K are dynamic symbols and the scale is a runtime scalar, so a program
is compiled once per (Dqk, Dv, sink, dtype, block sizes). K is padded with -1 to a multiple of
2 * block_k by the wrapper (the main loop handles the two buffers per trip).

Size: one file for the forward family (producer, the two consumer schedules, the config table
and the wrapper); the schedules share the producer and must stay in step with it.
"""

# no "from __future__ import annotations": TileLang evaluates the prim_func annotations

import functools
import math
import threading

import torch

from ..common.settings import decode_cluster_parts, decode_part_slots, logger
from ..common.indices import as_int32
from ..common.validation import check_scale, check_tensor, output_buffer
from . import aligned_operand, aligned_output, compiled_once, unread_arg, zeros_arg
from .cluster import CLUSTER_PRELUDE
from . import fast_exp2 as _ex2
from .row_scan import row_blocks_cuda

__all__ = [
    "DECODE_CLUSTER_CONFIGS",
    "PARTS_SCHEDULE",
    "DEFAULT_CONFIG",
    "SHIPPED_CONFIGS",
    "build_fwd_kernel",
    "config_for",
    "sparse_attention_fwd",
    "unsupported_reason",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

# Compile-time parameters of the family; everything else is a runtime argument.
DEFAULT_CONFIG: dict = {
    "dim_qk": 576,
    "dim_v": 512,
    "has_sink": False,
    "dtype": "bfloat16",
    "block_h": 64,  # heads per CTA (rows of every MMA); fewer heads are padded
    "block_k": 64,  # index slots per pipeline stage
    # None: "seesaw" for prefill rows, "qk_one" for the programs that exist for qk_one only (partial,
    # persistent_ctas, cluster_parts); the wrapper runs rows cut into parts on it (PARTS_SCHEDULE).
    # "seesaw": consumer 0 scores the even slot blocks and consumer 1 the odd ones; the running row
    #   maximum passes from one to the other, so one softmax overlaps the other's MMAs, and each
    #   accumulates its output half from both blocks' P (its own from registers, the peer's from
    #   shared memory). Balanced: each consumer does one score MMA and two P @ V MMAs per trip, and
    #   consumer 0 issues the next block's score MMAs behind its last P @ V. H100, interleaved A/B
    #   under CUDA graphs against qk_one: 1.06x at V4 H64 k256, 1.09-1.12x at k 512-2048 and at
    #   MLA H64 / H128 and V4 H128 (fwd_fixed_cost_h100.md);
    # "qk_one": consumer 0 computes all scores and the softmax, consumer 1 only its output half;
    # "split": both consumers compute half of the scores and half of the output (balanced, but the
    #   64x32 score MMAs are shared-memory bound: about 6% slower than qk_one);
    # "qk_one_async": qk_one with consumer 0's P @ V left in flight over the next score MMAs
    #   (correct but about 30% slower: the compiler serialises the in-flight accumulators)
    "schedule": None,
    # setmaxnreg budgets (producer, then consumer 0 and consumer 1); at most 504 in all. qk_one's consumer 0
    # (scores + softmax + half the output) needs more than consumer 1: (56; 224, 224) spilled
    # 108 bytes for MLA; this split spills 24 and measured 456 -> 490 TFLOP/s (MLA H128) and
    # 412 -> 429 (V4 H128) on an H200 with bitwise-equal outputs (tune_sparse_attention_fwd_regs.py).
    # None: the schedule's own budgets (_SCHEDULE_REGS)
    "producer_regs": None,
    "consumer_regs": None,
    # each query row walks its slot blocks only to its last valid slot (causal rows, the first
    # tokens of packed sequences: -1 after a few keys). H100, causal S 4096 k 2048: 1.26x (H64)
    # and 1.28x (H128) the full walk, bitwise the same outputs
    "skip_tail": True,
    # kv gather hints: None (plain cp.async), "l2_256" (each copy asks L2 for the whole 256-byte
    # span it starts, as the rows are read whole), "l2_256_keep" (the same with an evict_last
    # policy: the gathered rows are read again by the other head blocks and later queries)
    "load_hint": None,
    # the partial program (decode): fp32 partial outputs over slot ranges, merged by the combine
    # program; the wrapper runs it for one-query rows when DSA_PLUGINS_DECODE_PART_SLOTS is set
    "partial": False,
    # persistent grid of this many CTAs (0: one CTA per row block): each walks row blocks bx, bx + N,
    # ... and its producer gathers the next block's first stages while the consumers write the last
    # output and stage the next Q (qk_one and split only). Bitwise the plain grid but 0.75-0.80x its
    # speed on an H100 (132 CTAs): consumer 0 spills 276 bytes in the loop instead of 8
    # (fwd_fixed_cost_h100.md), so off
    "persistent_ctas": 0,
    # Q comes in with TMA (one thread issues it, the consumers wait on an mbarrier) and each consumer's
    # output half leaves with TMA stores, one 64-column tile at a time behind a barrier of that consumer's
    # own 128 threads (1.0-3.5% faster than one store per half), instead of 256 threads' vector loads and
    # stores: the SM's load/store pipe then carries only the gathers, and the next CTA's first gathers no
    # longer queue behind the last one's output. H100, interleaved A/B under CUDA graphs: 1.08x at V4 H64
    # k256, 1.06x at k512, 1.02-1.03x at k 1024-2048 and MLA H64/H128 (fwd_fixed_cost_h100.md). The
    # partial and persistent programs keep the threads' copies (tma_io is turned off for them)
    "tma_io": True,
    # launch CTAs in clusters of two (co-scheduled on neighbouring SMs), no shared memory traffic between
    # them: "heads" pairs the two head blocks of one query row (H 128), "rows" two adjacent query rows.
    # An experiment, off: a gather-only probe delivered 1.29-1.34x the bytes per second when the two CTAs
    # that read the same rows ran as a cluster (and 0.95x for distinct rows; probe_cluster_gather.py), but
    # the forward measured no faster under CUDA graphs on an H100 ("heads" 0.99-1.00x at H128, "rows"
    # 0.98-1.00x; fwd_fixed_cost_h100.md)
    "cluster": None,
    # decode (one query per row): the row's slots cut into this many parts (2, 4 or 8; 0: off), one CTA
    # each, launched as one cluster; each part leaves its normalised output (bf16 hi + lo) and log-sum-exp
    # in its own shared memory, and the cluster merges them through distributed shared memory (no fp32
    # partials in HBM, no second launch). The wrapper picks the count from k and the heads only (batch
    # invariant; common.settings.decode_cluster_parts)
    "cluster_parts": 0,
    # TileLang's automatic thread-storage syncs (a barrier of the warpgroup before shared-memory writes it
    # cannot prove safe). None: off for the seesaw, whose shared memory is ordered by its own barriers (the
    # producer's writes reach the consumers through mbarrier arrives of every producer thread; the maxima, P
    # and the output through named barriers of both consumers that every warp passes; each consumer's
    # stores into a tail its own score MMA read come after such a barrier), on for the other schedules.
    # Off: 1-2.6% faster prefill (interleaved A/B, H100), the same bits (GPU test)
    "auto_sync": None,
    # the softmax's exponentials (P and the rescale factor of every slot block) as ex2.approx.ftz: one MUFU.EX2
    # each. exp2f without fast math (which this program is compiled without) adds a compare and two FMULs per
    # exponential so that results below 2^-126 come out as denormals instead of 0; the consumers issue about
    # 100 such instructions per slot block (sm_90a SASS; the seesaw's consumer loops 782 + 990 -> 681 + 883). The
    # same values wherever P >= 2^-126 (NaN stays NaN, -inf gives 0). H100, interleaved A/B under CUDA graphs
    # against exp2f: MLA H128 / H64 k2048 1.04x, V4 H128 1.02x, V4 H64 k256-2048 1.00-1.02x; decode 1.03-1.07x
    "fast_exp2": True,
}

# The schedule of the programs that cut a generation step's row into parts (cluster_parts, partial): they
# exist for it only. Rows left whole, prefill or generation step (128 heads by default), run the default
# seesaw program, so a decode row gives the bits the same row gives in a prefill. H100, whole 128-head rows
# on the seesaw against qk_one, interleaved under CUDA graphs, k 2048 over 16K caches, MLA 576/512 / V4 D512
# with sink: B 1 1.19 / 1.18x, B 8 1.21 / 1.17x, B 32 1.03 / 1.04x, B 64 0.97 / 0.98x, B 128 0.98 / 0.98x
# (attention_decode.md).
PARTS_SCHEDULE = "qk_one"

# Every configuration the package ships. Heads, batch, lengths and K are runtime values, so one
# entry serves every head count listed in "covers" (H = 16/32 shards use the padded head block).
# Other (Dqk, Dv, sink) combinations compile on first use.
SHIPPED_CONFIGS: list[dict] = [
    {**DEFAULT_CONFIG, "dim_qk": 512, "dim_v": 512, "has_sink": True,
     "covers": "DeepSeek-V4 D512 with sink, H 16/32/64/128, and its generation steps of whole rows"},
    {**DEFAULT_CONFIG, "dim_qk": 576, "dim_v": 512, "has_sink": False,
     "covers": "absorbed MLA (V3.2 / GLM-5) 576/512, H 16/32/64/128, and its generation steps of whole rows"},
]

# The decode programs whose parts merge inside a cluster that the models' generation steps take by default
# (decode_cluster_parts: rows of up to 64 heads in two parts; 128-head rows whole); other part counts
# (DSA_PLUGINS_DECODE_ROW_CTAS) compile on first use or in `warmup`.
DECODE_CLUSTER_CONFIGS: list[dict] = [
    {**SHIPPED_CONFIGS[1], "cluster_parts": 2, "covers": "GLM-5 (64 heads) generation steps, absorbed MLA 576/512"},
    {**SHIPPED_CONFIGS[0], "cluster_parts": 2, "covers": "DeepSeek-V4 64-head generation steps, D512 with sink"},
]

_SCHEDULES = ("qk_one", "qk_one_async", "split", "seesaw")
# setmaxnreg budgets (producer, (consumer 0, consumer 1)) of each schedule: qk_one's consumer 0
# does more than consumer 1; seesaw's two consumers do the same work
_SCHEDULE_REGS = {
    "qk_one": (48, (256, 200)),
    "qk_one_async": (48, (256, 200)),
    "split": (48, (256, 200)),
    "seesaw": (56, (224, 224)),
}
_COMPILE_KEYS = ("dim_qk", "dim_v", "has_sink", "dtype", "block_h", "block_k", "schedule", "producer_regs",
                 "consumer_regs", "skip_tail", "load_hint", "partial", "persistent_ctas", "tma_io", "cluster",
                 "cluster_parts", "auto_sync", "fast_exp2")
_LOAD_HINTS = {None: 0, "l2_256": 1, "l2_256_keep": 2}
_CLUSTER_DIMS = {None: None, "heads": (2, 1, 1), "rows": (1, 2, 1)}

# predicated 16-byte cp.async with L2 hints (TileLang's own cp.async takes none)
_FWD_PRELUDE = r"""
template <int kHint>
__device__ __forceinline__ void dsa_cp_async16(const void* smem, const void* gmem, bool pred) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = pred ? 16 : 0;
  if constexpr (kHint == 2) {
    unsigned long long policy;
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;"
                 :: "r"(dst), "l"(gmem), "r"(n), "l"(policy) : "memory");
  } else {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" :: "r"(dst), "l"(gmem), "r"(n) : "memory");
  }
}
"""

# decode parts merged inside a cluster (cluster_parts): the cluster barrier and loads from a peer CTA's shared
# memory (mapa + ld.shared::cluster). The asm is volatile so that no load moves across the barrier.
_CLUSTER_PRELUDE = CLUSTER_PRELUDE + r"""
__device__ __forceinline__ float dsa_peer_f32(const void* p, int rank) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(dsa_peer_addr(p, rank)) : "memory");
  return v;
}

__device__ __forceinline__ uint4 dsa_peer_u128(const void* p, int rank) {
  uint4 v;
  asm volatile("ld.shared::cluster.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(dsa_peer_addr(p, rank)) : "memory");
  return v;
}

template <bool kBf16>
__device__ __forceinline__ float dsa_half_bits(unsigned bits) {
  if constexpr (kBf16) {
    return __uint_as_float(bits << 16);
  } else {
    float f;  // the prelude precedes cuda_fp16.h: convert with PTX
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(static_cast<unsigned short>(bits)));
    return f;
  }
}

// raw[0..3] = the 8 16-bit floats at hi, raw[4..7] those at lo (16 bytes each) in CTA `rank`'s shared memory
__device__ __forceinline__ void dsa_peer_hilo(unsigned* raw, const void* hi, const void* lo, int rank) {
  const uint4 a = dsa_peer_u128(hi, rank), b = dsa_peer_u128(lo, rank);
  raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w;
  raw[4] = b.x; raw[5] = b.y; raw[6] = b.z; raw[7] = b.w;
}

// acc[j] += w * (hi[j] + lo[j]), j < 8, from the words dsa_peer_hilo loaded
template <bool kBf16>
__device__ __forceinline__ void dsa_hilo_axpy8(float* acc, float w, const unsigned* raw) {
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += w * (dsa_half_bits<kBf16>(raw[i] & 0xffffu) + dsa_half_bits<kBf16>(raw[4 + i] & 0xffffu));
    acc[2 * i + 1] += w * (dsa_half_bits<kBf16>(raw[i] >> 16) + dsa_half_bits<kBf16>(raw[4 + i] >> 16));
  }
}
"""

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in _TORCH_DTYPES.items()}

# Named barriers used explicitly by the kernel (bar.sync ids). TileLang numbers the barriers it
# inserts itself from 3 upwards (one per thread range: 3 to 5 here), so ours sit at the top.
_BAR_Q, _BAR_A, _BAR_B, _BAR_FIN, _BAR_OUT = 15, 14, 13, 12, 11
# seesaw: row maximum of consumer 0 / 1 posted (_BAR_A / _BAR_B), P of its block in shared memory
_BAR_M0, _BAR_M1, _BAR_S0, _BAR_S1 = _BAR_A, _BAR_B, 10, 9
# persistent: the consumers are done with the last row block's output before staging the next Q
_BAR_NEXT = 8


def _takes_cluster_parts(cfg: dict) -> bool:
    """The decode cluster split exists for the plain qk_one and seesaw programs (no partial, persistent or
    cluster)."""
    return cfg["schedule"] in ("qk_one", "seesaw") and not (cfg["partial"] or cfg["persistent_ctas"] or cfg["cluster"])


def _normalise_config(config: dict) -> dict:
    """The full, checked configuration of ``config`` (a fresh dict). Every call of the wrapper normalises
    its configuration twice (choosing it, then finding its program): checked once per distinct input."""
    items = tuple(config.get(k, DEFAULT_CONFIG[k]) for k in _COMPILE_KEYS)
    try:
        return dict(_normalised(items))
    except TypeError:  # an unhashable value (a list of register budgets): checked without the cache
        return _check_config(dict(zip(_COMPILE_KEYS, items)))


@functools.lru_cache(maxsize=256)
def _normalised(items: tuple) -> dict:
    return _check_config(dict(zip(_COMPILE_KEYS, items)))


def _check_config(cfg: dict) -> dict:
    dqk, dv, bk, bh = cfg["dim_qk"], cfg["dim_v"], cfg["block_k"], cfg["block_h"]
    if cfg["dtype"] not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {cfg['dtype']!r}")
    if dv % 32 != 0 or dv < 32:
        raise ValueError(f"dim_v must be a positive multiple of 32, got {dv}")
    if dqk < dv or (dqk - dv) % 16 != 0:
        raise ValueError(f"dim_qk must be dim_v plus a multiple of 16, got dim_qk={dqk}, dim_v={dv}")
    if bh != 64:
        raise ValueError(f"block_h must be 64 (one warpgroup MMA tile), got {bh}")
    if bk != 64:
        raise ValueError(f"block_k must be 64, got {bk}")
    if cfg["schedule"] is None:
        qk_one_only = cfg["partial"] or cfg["persistent_ctas"] or cfg["cluster_parts"] not in (0, 1, None)
        cfg["schedule"] = "qk_one" if qk_one_only else "seesaw"
    if cfg["schedule"] not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {cfg['schedule']!r}")
    default_producer, default_consumers = _SCHEDULE_REGS[cfg["schedule"]]
    if cfg["producer_regs"] is None:
        cfg["producer_regs"] = default_producer
    regs = default_consumers if cfg["consumer_regs"] is None else cfg["consumer_regs"]
    regs = (int(regs), int(regs)) if isinstance(regs, (int, float)) else tuple(int(r) for r in regs)
    cfg["consumer_regs"] = regs
    cfg["producer_regs"] = int(cfg["producer_regs"])
    all_regs = (cfg["producer_regs"],) + regs
    # setmaxnreg moves registers between the warpgroups of the CTA: the three budgets must fit in
    # what the CTA was launched with (168 per thread at 384 threads), or an increase waits forever.
    if len(regs) != 2 or any(r % 8 or not 24 <= r <= 256 for r in all_regs) or sum(all_regs) > 3 * 168:
        raise ValueError(
            "producer_regs and consumer_regs (one value or one per consumer) must be multiples of 8 in "
            f"[24, 256] summing to at most 504, got {all_regs}"
        )
    if cfg["load_hint"] not in _LOAD_HINTS:
        raise ValueError(f"load_hint must be one of {sorted(_LOAD_HINTS, key=str)}, got {cfg['load_hint']!r}")
    cfg["has_sink"] = bool(cfg["has_sink"])
    cfg["partial"] = bool(cfg["partial"])
    if cfg["partial"] and cfg["has_sink"]:
        raise ValueError("the partial program takes no sink (the combine applies it)")
    if cfg["partial"] and cfg["schedule"] not in ("qk_one", "split"):
        raise ValueError(f"partial takes the qk_one or split schedule, got {cfg['schedule']!r}")
    cfg["skip_tail"] = bool(cfg["skip_tail"])
    cfg["persistent_ctas"] = int(cfg["persistent_ctas"] or 0)
    if cfg["persistent_ctas"] and (cfg["persistent_ctas"] < 0 or cfg["schedule"] not in ("qk_one", "split")
                                   or cfg["partial"]):
        raise ValueError("persistent_ctas must be >= 0 and takes the qk_one or split schedule without partial, got "
                         f"{cfg['persistent_ctas']} with {cfg['schedule']!r}, partial={cfg['partial']}")
    cfg["tma_io"] = bool(cfg["tma_io"]) and not cfg["partial"] and not cfg["persistent_ctas"]
    cfg["auto_sync"] = cfg["schedule"] != "seesaw" if cfg["auto_sync"] is None else bool(cfg["auto_sync"])
    cfg["fast_exp2"] = True if cfg["fast_exp2"] is None else bool(cfg["fast_exp2"])
    if not cfg["auto_sync"] and cfg["schedule"] != "seesaw":
        raise ValueError(f"auto_sync=False is verified for the seesaw schedule only (its barriers order its shared "
                         f"memory), got schedule {cfg['schedule']!r}")
    if cfg["cluster"] not in _CLUSTER_DIMS:
        raise ValueError(f"cluster must be one of {sorted(_CLUSTER_DIMS, key=str)}, got {cfg['cluster']!r}")
    if cfg["cluster"] and cfg["persistent_ctas"]:
        raise ValueError("cluster takes the plain grid (persistent_ctas=0)")
    if cfg["cluster"] and cfg["load_hint"]:
        # both experiments, both off by default: cluster "heads" with "l2_256_keep" stopped an H200 with an illegal
        # instruction at S 4096 x Skv 32768 (H 128, seesaw), each alone did not (fwd_fixed_cost_h100.md); "l2_256"
        # with a cluster was not run at that size, so it is refused too
        raise ValueError(f"cluster={cfg['cluster']!r} cannot be combined with load_hint={cfg['load_hint']!r} (a "
                         "clustered launch with the evict_last gathers faulted on an H200); use one of the two")
    parts = int(cfg["cluster_parts"] or 0)
    cfg["cluster_parts"] = 0 if parts == 1 else parts
    if parts not in (0, 1, 2, 4, 8):
        raise ValueError(f"cluster_parts must be 0, 2, 4 or 8, got {cfg['cluster_parts']}")
    if cfg["cluster_parts"] and not _takes_cluster_parts(cfg):
        raise ValueError("cluster_parts takes the qk_one or seesaw schedule on the plain grid (no partial, "
                         "persistent_ctas or cluster)")
    return cfg


def _program(dim_qk, dim_v, has_sink, dtype, block_h, block_k, schedule, producer_regs, consumer_regs,
             skip_tail=False, load_hint=None, partial=False, persistent_ctas=0, tma_io=False, cluster=None,
             cluster_parts=0, auto_sync=True, fast_exp2=False):
    """The TileLang prim_func of one configuration (imported lazily). ``auto_sync`` is not read here: it is a
    pass option of the compile (``_jit_for_target``), an argument so that it keys the caches."""
    import tilelang.language as T

    D_half = dim_v // 2  # value columns per consumer warpgroup
    D_tail = dim_qk - dim_v  # score-only columns (rope part of absorbed MLA)
    HB = block_h
    BK = block_k
    split = schedule == "split"
    async_pv = schedule == "qk_one_async"
    seesaw = schedule == "seesaw"
    # rows of one shared buffer: "split" keeps each slot half in its own buffer (one per consumer)
    ROWS_BUF = BK // 2 if split else BK
    ROWS_PER_PASS = 16  # producer: 8 threads per row, 128 threads
    PASSES = BK // ROWS_PER_PASS
    VEC = 8  # elements per 16-byte copy
    n_half_chunks = (D_half + 63) // 64
    half_guard = D_half % 64 != 0
    n_tail_chunks = (D_tail + 63) // 64
    tail_guard = D_tail % 64 != 0
    # Python tuples: loops over them are unrolled while the program is built (static indices)
    pass_ids = tuple(range(PASSES))
    half_chunk_ids = tuple(range(n_half_chunks))
    tail_chunk_ids = tuple(range(n_tail_chunks))
    accum = "float32"
    neg_big = -1.0e30

    B, S, H, SKV, KP = T.dynamic("batch, seqlen, heads, seqlen_kv, topk_padded")
    # partial: each query row's slots come as `parts` consecutive rows of Indices (SO = S * parts
    # rows), each scored by a CTA of its own into an fp32 partial output and its lse (no sink:
    # the combine applies it); the decode shape, where the batch alone leaves most SMs idle
    # cluster_parts: part p of query row s is row s * parts + p as well (the parts of a row form a cluster)
    SO = T.dynamic("rows_out") if partial or cluster_parts else S
    P = cluster_parts
    out_dtype = accum if partial else dtype

    hint = _LOAD_HINTS[load_hint]

    def exp2(x):
        # the main loop's exponentials (see DEFAULT_CONFIG["fast_exp2"]); the epilogue keeps exp2f
        return _ex2.exp2(T, x, fast_exp2)

    def cp16(dst, src, ok):
        # a plain function, not a macro: a macro would bind the pointers to (non-const) variables
        if hint == 0:
            return T.ptx_cp_async(dst, src, VEC, ok)
        return T.call_extern("handle", f"dsa_cp_async16<{hint}>", dst, src, ok)

    @T.macro
    def fetch_indices(Indices, bz, by, it, idx_reg, ptx):
        for r in pass_ids:
            idx_reg[r] = Indices[bz, by, it * BK + r * ROWS_PER_PASS + ptx // 8]

    @T.macro
    def load_stage(KV, bz, idx_reg, kv_l, kv_r, kt, valid_s, ptx):
        # kv_l / kv_r / kt: lists of the row blocks of one stage (shared buffers). cp.async with a
        # false predicate reads nothing and fills zeros: an invalid index is never dereferenced
        # (its address is also clamped to row 0) and its row stays finite for P @ V.
        lane = ptx % 8
        if lane == 0:
            for r in pass_ids:
                valid_s[r * ROWS_PER_PASS + ptx // 8] = T.if_then_else(
                    (idx_reg[r] >= 0) and (idx_reg[r] < SKV), 1, 0)
        for r in pass_ids:
            row = r * ROWS_PER_PASS + ptx // 8
            blk = (r * ROWS_PER_PASS) // ROWS_BUF  # static: a pass never straddles two buffers
            brow = row - blk * ROWS_BUF
            idx = idx_reg[r]
            ok = (idx >= 0) and (idx < SKV)
            src = T.if_then_else(ok, idx, 0)
            for u in half_chunk_ids:
                col = u * 64 + lane * VEC
                if (not half_guard) or col < D_half:
                    cp16(T.access_ptr(kv_l[blk][brow, col], "w", VEC),
                                   T.access_ptr(KV[bz, src, col], "r", VEC), ok)
                    cp16(T.access_ptr(kv_r[blk][brow, col], "w", VEC),
                                   T.access_ptr(KV[bz, src, D_half + col], "r", VEC), ok)
            if D_tail > 0:
                for u in tail_chunk_ids:
                    col = u * 64 + lane * VEC
                    if (not tail_guard) or col < D_tail:
                        cp16(T.access_ptr(kt[blk][brow, col], "w", VEC),
                                       T.access_ptr(KV[bz, src, dim_v + col], "r", VEC), ok)

    @T.macro
    def producer(Indices, KV, bz, by, n_trips, idx_reg, stages, valid, bar_ready, bar_free, ptx, base):
        # base: trips of the CTA's earlier rows (persistent), so that the barrier phases run on
        fetch_indices(Indices, bz, by, 0, idx_reg, ptx)
        for t in T.serial(n_trips):
            for st in (0, 1):
                kv_l, kv_r, kt = stages[st]
                T.barrier_wait(bar_free[st][0], ((base + t) & 1) ^ 1)
                load_stage(KV, bz, idx_reg, kv_l, kv_r, kt, valid[st], ptx)
                T.cp_async_barrier_noinc(bar_ready[st][0])
                T.barrier_arrive(bar_ready[st][0])
                # indices of the next stage, in flight while this one lands
                if st == 0:
                    fetch_indices(Indices, bz, by, 2 * t + 1, idx_reg, ptx)
                else:
                    if t + 1 < n_trips:
                        fetch_indices(Indices, bz, by, 2 * t + 2, idx_reg, ptx)

    @T.macro
    def scores(Q_l, Q_r, Q_t, k_l, k_r, k_t, acc_s):
        T.wgmma_gemm(Q_l, k_l, acc_s, transpose_B=True, clear_accum=True)
        T.wgmma_gemm(Q_r, k_r, acc_s, transpose_B=True)
        if D_tail > 0:
            T.wgmma_gemm(Q_t, k_t, acc_s, transpose_B=True)
        T.wait_wgmma(0)

    @T.macro
    def split_stage(g, c, Q_l, Q_r, Q_t, kv_l, kv_r, kt, valid_s, acc_s, acc_o, m_i, m_loc, alpha, l_i,
                    rowsum, mx_s, P_s):
        # consumer g: scores of slot half g (64 heads x BK/2 slots), then output columns of half g
        scores(Q_l, Q_r, Q_t, kv_l[g], kv_r[g], kt[g] if D_tail > 0 else None, acc_s)
        for h, j in T.Parallel(HB, ROWS_BUF):
            acc_s[h, j] = T.if_then_else(valid_s[g * ROWS_BUF + j] != 0, acc_s[h, j], -T.infinity(accum))
        T.reduce_max(acc_s, m_loc, dim=1, clear=True)
        for h in T.Parallel(HB):
            mx_s[g, h] = T.max(m_loc[h], m_i[h])
        T.sync_threads(_BAR_A, 256)
        for h in T.Parallel(HB):
            m_loc[h] = T.max(mx_s[0, h], mx_s[1, h])
            alpha[h] = exp2((m_i[h] - m_loc[h]) * c)
            m_i[h] = m_loc[h]
            m_loc[h] = m_loc[h] * c
        for h, j in T.Parallel(HB, ROWS_BUF):
            acc_s[h, j] = exp2(acc_s[h, j] * c - m_loc[h])
        T.reduce_sum(acc_s, rowsum, dim=1)
        for h in T.Parallel(HB):
            l_i[h] = l_i[h] * alpha[h] + rowsum[h]
        for h, d in T.Parallel(HB, D_half):
            acc_o[h, d] *= alpha[h]
        T.copy(acc_s, P_s[g])
        T.fence_proxy_async()
        T.sync_threads(_BAR_B, 256)
        T.wgmma_gemm(P_s[0], kv_l[0] if g == 0 else kv_r[0], acc_o)
        T.wgmma_gemm(P_s[1], kv_l[1] if g == 0 else kv_r[1], acc_o)
        T.wait_wgmma(0)

    @T.macro
    def softmax_stage(c, Q_l, Q_r, Q_t, kv_l, kv_r, kt, valid_s, acc_s, acc_o, m_i, m_loc, alpha, l_i,
                      rowsum, alpha_s, P_s, wait_free, prev_free, release_prev):
        # consumer 0 of the "qk_one" schedules: all scores of the stage, softmax, left output half
        scores(Q_l, Q_r, Q_t, kv_l[0], kv_r[0], kt[0] if D_tail > 0 else None, acc_s)
        if async_pv:
            # the wait above also retired P @ V of the previous stage: its buffer is free
            if release_prev:
                T.barrier_arrive(prev_free[0])
        for h, j in T.Parallel(HB, BK):
            acc_s[h, j] = T.if_then_else(valid_s[j] != 0, acc_s[h, j], -T.infinity(accum))
        T.reduce_max(acc_s, m_loc, dim=1, clear=True)
        for h in T.Parallel(HB):
            m_loc[h] = T.max(m_loc[h], m_i[h])
            alpha[h] = exp2((m_i[h] - m_loc[h]) * c)
            m_i[h] = m_loc[h]
            m_loc[h] = m_loc[h] * c
        for h, j in T.Parallel(HB, BK):
            acc_s[h, j] = exp2(acc_s[h, j] * c - m_loc[h])
        T.reduce_sum(acc_s, rowsum, dim=1)
        for h in T.Parallel(HB):
            l_i[h] = l_i[h] * alpha[h] + rowsum[h]
        for h, d in T.Parallel(HB, D_half):
            acc_o[h, d] *= alpha[h]
        if wait_free:
            T.sync_threads(_BAR_B, 256)  # consumer 1 is done with the previous P and alpha
        for h in T.Parallel(HB):
            alpha_s[0, h] = alpha[h]
        T.copy(acc_s, P_s[0])
        T.fence_proxy_async()
        T.named_barrier_arrive(_BAR_A, 256)  # P and alpha ready
        if async_pv:
            T.wgmma_gemm(P_s[0], kv_l[0], acc_o)  # retired by the next stage's wait
        else:
            T.gemm(P_s[0], kv_l[0], acc_o)

    @T.macro
    def pv_stage(kv_r, acc_o, alpha_s, P_s, release):
        # consumer 1 of the "qk_one" schedule: right output half
        T.sync_threads(_BAR_A, 256)
        for h, d in T.Parallel(HB, D_half):
            acc_o[h, d] *= alpha_s[0, h]
        T.gemm(P_s[0], kv_r[0], acc_o)
        if release:
            T.named_barrier_arrive(_BAR_B, 256)

    @T.macro
    def cluster_merge(g, mc, l_tot, m_i, inv, acc_o, stages, cl, Sinks, Output, Lse, bz, by, h0):
        # consumer g of part p = by % P of a decode row: (1) its output half, normalised by its own row sums,
        # goes to stage g's value buffers as bf16 hi + lo (a 16-bit mantissa: the stages are free once
        # both consumers passed _BAR_FIN) and consumer 0 posts each head's log2-sum-exp (-inf: no valid
        # slot); (2) cluster barrier; (3) part p merges heads [p HB / P, (p + 1) HB / P) of column half g
        # from all P parts in part order, weights 2^(lse_q - max) (sink in the normaliser), and writes the
        # output and lse; (4) a second barrier keeps every CTA's shared memory alive until all have read it.
        lp_s, lq, acc8, sc, raw = cl
        hi_s, lo_s = stages[g][0][0], stages[g][1][0]
        for h in T.Parallel(HB):
            inv[h] = T.if_then_else(l_tot[h] != 0, 1.0 / l_tot[h], 0.0)
        for h, d in T.Parallel(HB, D_half):
            hi_s[h, d] = T.cast(acc_o[h, d] * inv[h], dtype)
            lo_s[h, d] = T.cast(acc_o[h, d] * inv[h] - T.cast(T.cast(acc_o[h, d] * inv[h], dtype), accum), dtype)
        if g == 0:
            for h in T.Parallel(HB):
                lp_s[h] = T.if_then_else(l_tot[h] != 0, T.log2(l_tot[h]) + m_i[h] * mc, -T.infinity(accum))
        T.call_extern("handle", "dsa_cluster_sync")
        part = by % P
        ct = T.get_thread_binding() % 128
        heads_per_part = HB // P
        n_chunks = D_half // 8  # 8 columns (16 bytes) per load
        n_items = heads_per_part * n_chunks
        for it in T.serial((n_items + 127) // 128):
            item = it * 128 + ct
            if item < n_items:
                h = part * heads_per_part + item // n_chunks
                col = (item % n_chunks) * 8
                # every peer load is issued before the first is used (one round trip, not 2 P)
                for q in T.unroll(P):
                    lq[q] = T.call_extern(accum, "dsa_peer_f32", T.access_ptr(lp_s[h], "r", 1), q)
                for q in T.unroll(P):
                    T.call_extern("handle", "dsa_peer_hilo", T.address_of(raw[q * 8]),
                                  T.access_ptr(hi_s[h, col], "r", 8), T.access_ptr(lo_s[h, col], "r", 8), q)
                sc[0] = -T.infinity(accum)
                for q in T.unroll(P):
                    sc[0] = T.max(sc[0], lq[q])  # fmaxf: a NaN part is skipped here, its weight is NaN below
                sc[1] = 0.0
                for j in T.unroll(8):
                    acc8[j] = 0.0
                for q in T.unroll(P):
                    sc[2] = T.if_then_else(lq[q] == -T.infinity(accum), 0.0, T.exp2(lq[q] - sc[0]))
                    sc[1] = sc[1] + sc[2]
                    T.call_extern("handle", f"dsa_hilo_axpy8<{'true' if dtype == 'bfloat16' else 'false'}>",
                                  T.address_of(acc8[0]), sc[2], T.address_of(raw[q * 8]))
                if has_sink:
                    sc[2] = T.if_then_else(
                        sc[1] != 0, 1.0 / (sc[1] + T.exp2(Sinks[T.min(h0 + h, H - 1)] * _LOG2E - sc[0])), 0.0)
                else:
                    sc[2] = T.if_then_else(sc[1] != 0, 1.0 / sc[1], 0.0)
                if h0 + h < H:
                    for j in T.unroll(8):
                        Output[bz, by // P, h0 + h, g * D_half + col + j] = T.cast(acc8[j] * sc[2], dtype)
                    if g == 0 and col == 0:
                        Lse[bz, by // P, h0 + h] = T.if_then_else(
                            sc[1] != 0, (T.log2(sc[1]) + sc[0]) * _LN2, T.infinity(accum))
        T.call_extern("handle", "dsa_cluster_sync")

    @T.macro
    def finish(g, c, l_tot, m_i, inv, acc_o, O_s, Sinks, Output, Lse, bz, by, h0, m_scaled=False, stages=None,
               cl=None):
        # l_tot: row sums of the whole row; m_i: the row maximum of the scores (times c when
        # m_scaled); writes lse (consumer 0) and the output half g. A row is
        # empty when l_tot == 0 (every slot masked): tested with != 0, not > 0, so that a row whose
        # inputs carry NaN keeps NaN in its output and lse instead of passing for empty (+inf).
        # cluster_parts: the row's parts merge through distributed shared memory (cluster_merge)
        mc = 1.0 if m_scaled else c
        if P:
            cluster_merge(g, mc, l_tot, m_i, inv, acc_o, stages, cl, Sinks, Output, Lse, bz, by, h0)
        else:
            for h in T.Parallel(HB):
                if has_sink:
                    inv[h] = T.if_then_else(
                        l_tot[h] != 0,
                        1.0 / (l_tot[h] + T.exp2(Sinks[T.min(h0 + h, H - 1)] * _LOG2E - m_i[h] * mc)),
                        0.0,
                    )
                else:
                    inv[h] = T.if_then_else(l_tot[h] != 0, 1.0 / l_tot[h], 0.0)
            if not partial and not tma_io:
                for h, d in T.Parallel(HB, D_half):
                    O_s[h, d] = T.cast(acc_o[h, d] * inv[h], dtype)
            if g == 0:
                for h in T.Parallel(HB):
                    if h0 + h < H:
                        Lse[bz, by, h0 + h] = T.if_then_else(
                            l_tot[h] != 0, (T.log2(l_tot[h]) + m_i[h] * mc) * _LN2, T.infinity(accum)
                        )
            if partial:
                # fp32 partials straight from the registers (a decode step writes few of them)
                for h, d in T.Parallel(HB, D_half):
                    if h0 + h < H:
                        Output[bz, by, h0 + h, g * D_half + d] = acc_o[h, d] * inv[h]
            elif tma_io:
                # one 64-column tile at a time: converted into shared memory, then out by a TMA store (rows
                # past H fall outside the tensor and are not written) while the next tile is converted. The
                # consumer's own 128 threads sync (its output half is its own buffer; the loop's barriers are
                # done with after _BAR_FIN, so their ids serve here)
                for u in half_chunk_ids:
                    cols = min(64, D_half - u * 64)  # Python ints: the last tile of a narrow half
                    for h, d in T.Parallel(HB, 64):
                        if (not half_guard) or u * 64 + d < D_half:
                            O_s[h, u * 64 + d] = T.cast(acc_o[h, u * 64 + d] * inv[h], dtype)
                    T.fence_proxy_async()
                    T.sync_threads(_BAR_A if g == 0 else _BAR_B, 128)
                    T.tma_copy(O_s[0:HB, u * 64 : u * 64 + cols],
                               Output[bz, by, h0 : h0 + HB, g * D_half + u * 64 : g * D_half + u * 64 + cols])
                T.tma_store_wait()
            else:
                T.sync_threads(_BAR_OUT, 256)
                for h, d in T.Parallel(HB, D_half):
                    if h0 + h < H:
                        Output[bz, by, h0 + h, g * D_half + d] = O_s[h, d]


    @T.macro
    def load_part(KV, bz, idx_reg, stage, part, valid_s, ptx):
        # seesaw: one half of a stage, "left" (value columns [0, Dv/2)) or "right" (the rest of
        # the value columns and the score-only tail); the slot flags go with the half loaded first
        kv_l, kv_r, kt = stage
        lane = ptx % 8
        if valid_s is not None:
            if lane == 0:
                for r in pass_ids:
                    valid_s[r * ROWS_PER_PASS + ptx // 8] = T.if_then_else(
                        (idx_reg[r] >= 0) and (idx_reg[r] < SKV), 1, 0)
        for r in pass_ids:
            row = r * ROWS_PER_PASS + ptx // 8
            idx = idx_reg[r]
            ok = (idx >= 0) and (idx < SKV)
            src = T.if_then_else(ok, idx, 0)
            for u in half_chunk_ids:
                col = u * 64 + lane * VEC
                if (not half_guard) or col < D_half:
                    if part == "left":
                        cp16(T.access_ptr(kv_l[0][row, col], "w", VEC),
                                       T.access_ptr(KV[bz, src, col], "r", VEC), ok)
                    else:
                        cp16(T.access_ptr(kv_r[0][row, col], "w", VEC),
                                       T.access_ptr(KV[bz, src, D_half + col], "r", VEC), ok)
            if D_tail > 0 and part == "right":
                for u in tail_chunk_ids:
                    col = u * 64 + lane * VEC
                    if (not tail_guard) or col < D_tail:
                        cp16(T.access_ptr(kt[0][row, col], "w", VEC),
                                       T.access_ptr(KV[bz, src, dim_v + col], "r", VEC), ok)

    @T.macro
    def seesaw_producer(Indices, KV, bz, by, n_trips, idx0, idx1, stages, valid, ready, free, ptx):
        # per trip: block 2t left, block 2t+1 right, block 2t right, block 2t+1 left. Each half has
        # its own barriers: a half is reloaded as soon as its last reader is done with it, and each
        # consumer starts its score MMAs on the half that lands first
        fetch_indices(Indices, bz, by, 0, idx0, ptx)
        fetch_indices(Indices, bz, by, 1, idx1, ptx)
        for t in T.serial(n_trips):
            for st, part, hf in ((0, "left", 0), (1, "right", 1), (0, "right", 1), (1, "left", 0)):
                first = (st == 0 and part == "left") or (st == 1 and part == "right")
                T.barrier_wait(free[st][hf][0], (t & 1) ^ 1)
                load_part(KV, bz, idx0 if st == 0 else idx1, stages[st], part, valid[st] if first else None, ptx)
                T.cp_async_barrier_noinc(ready[st][hf][0])
                T.barrier_arrive(ready[st][hf][0])
                if not first:  # this block's indices are done with: the next trip's, in flight
                    if t + 1 < n_trips:
                        fetch_indices(Indices, bz, by, 2 * t + 2 + st, idx0 if st == 0 else idx1, ptx)

    @T.macro
    def seesaw_issue(Q_l, Q_r, Q_t, stage, ready, st, t, acc_s, which):
        # score MMAs of one half of a slot block (which = 0: the half that lands first), issued
        # after that half has landed; not waited for
        kv_l, kv_r, kt = stage
        hf = (0 if st == 0 else 1) if which == 0 else (1 if st == 0 else 0)
        T.barrier_wait(ready[st][hf][0], t & 1)
        T.fence_proxy_async()
        if hf == 0:
            T.wgmma_gemm(Q_l, kv_l[0], acc_s, transpose_B=True, clear_accum=which == 0)
        else:
            T.wgmma_gemm(Q_r, kv_r[0], acc_s, transpose_B=True, clear_accum=which == 0)
            if D_tail > 0:
                T.wgmma_gemm(Q_t, kt[0], acc_s, transpose_B=True)

    @T.macro
    def seesaw_mask_max(valid_s, acc_s, m_blk):
        # invalid slots at -inf; row maxima of the block
        for h, j in T.Parallel(HB, BK):
            acc_s[h, j] = T.if_then_else(valid_s[j] != 0, acc_s[h, j], -T.infinity(accum))
        T.reduce_max(acc_s, m_blk, dim=1, clear=True)

    @T.macro
    def seesaw_scores(Q_l, Q_r, Q_t, stage, ready, st, t, acc_s):
        # scores of one whole slot block (64 heads x 64 slots), started on the half that lands first
        seesaw_issue(Q_l, Q_r, Q_t, stage, ready, st, t, acc_s, 0)
        seesaw_issue(Q_l, Q_r, Q_t, stage, ready, st, t, acc_s, 1)
        T.wait_wgmma(0)

    @T.macro
    def seesaw_softmax(c, acc_s, acc_o, m_i, m_new, alpha, l_i, rowsum):
        # m_new: the new running maximum (times c); P = exp2(s c - m_new) in acc_s, acc_o and the
        # row sums rescaled from m_i to m_new
        for h in T.Parallel(HB):
            alpha[h] = exp2(m_i[h] - m_new[h])
            m_i[h] = m_new[h]
        for h, j in T.Parallel(HB, BK):
            acc_s[h, j] = exp2(acc_s[h, j] * c - m_i[h])
        T.reduce_sum(acc_s, rowsum, dim=1)
        for h in T.Parallel(HB):
            l_i[h] = l_i[h] * alpha[h] + rowsum[h]
        for h, d in T.Parallel(HB, D_half):
            acc_o[h, d] *= alpha[h]

    @T.macro
    def seesaw_even(c, Q_l, Q_r, Q_t, stages, valid, P0_s, P1_s, mx_s, acc_s, p_reg, acc_o, m_i, m_blk, alpha,
                    l_i, rowsum, ready, free, t, n_trips):
        # consumer 0, slot block 2t (stage 0): left output half of both blocks. Block 2t's scores are
        # already in acc_s (issued before the loop or by the previous trip); this trip issues block
        # 2t+2's behind its last P @ V, so the tensor cores take them while that P @ V runs
        seesaw_mask_max(valid[0], acc_s, m_blk)
        for h in T.Parallel(HB):
            m_blk[h] = T.max(m_i[h], m_blk[h] * c)
            mx_s[0, h] = m_blk[h]
        # consumer 1 continues the maximum from here: posted before this softmax, so that its own
        # softmax runs beside this one instead of after it
        T.named_barrier_arrive(_BAR_M0, 256)
        seesaw_softmax(c, acc_s, acc_o, m_i, m_blk, alpha, l_i, rowsum)
        T.copy(acc_s, p_reg)
        T.wgmma_gemm(p_reg, stages[0][0][0], acc_o)
        # block 2t's left half is read by this consumer only: released as soon as this P @ V is done,
        # not after the exchange below, so that the producer refills it while the maxima pass (with
        # only two stages, a late release left the next block's scores waiting for their rows)
        T.wait_wgmma(0)
        T.barrier_arrive(free[0][0][0])
        T.sync_threads(_BAR_M1, 256)
        for h in T.Parallel(HB):
            alpha[h] = exp2(m_i[h] - mx_s[1, h])  # block 2t + 1 raised the maximum by this
            m_i[h] = mx_s[1, h]
        for h, j in T.Parallel(HB, BK):
            acc_s[h, j] *= alpha[h]
        T.copy(acc_s, P0_s)
        T.fence_proxy_async()
        T.named_barrier_arrive(_BAR_S0, 256)
        for h, d in T.Parallel(HB, D_half):
            acc_o[h, d] *= alpha[h]
        for h in T.Parallel(HB):
            l_i[h] *= alpha[h]
        T.sync_threads(_BAR_S1, 256)
        T.wgmma_gemm(P1_s, stages[1][0][0], acc_o)
        if t + 1 < n_trips:
            seesaw_issue(Q_l, Q_r, Q_t, stages[0], ready, 0, t + 1, acc_s, 0)
            T.wait_wgmma(1)
            T.barrier_arrive(free[1][0][0])  # block 2t+1's left half (consumer 1 scored it before P1)
            seesaw_issue(Q_l, Q_r, Q_t, stages[0], ready, 0, t + 1, acc_s, 1)
            T.wait_wgmma(0)
        else:
            T.wait_wgmma(0)
            T.barrier_arrive(free[1][0][0])

    @T.macro
    def seesaw_odd(c, Q_l, Q_r, Q_t, stages, valid, P0_s, P1_s, mx_s, acc_s, p_reg, acc_o, m_i, m_blk, alpha,
                   l_i, rowsum, ready, free, t):
        # consumer 1, slot block 2t + 1 (stage 1): right output half of both blocks
        seesaw_scores(Q_l, Q_r, Q_t, stages[1], ready, 1, t, acc_s)
        seesaw_mask_max(valid[1], acc_s, m_blk)
        T.sync_threads(_BAR_M0, 256)  # consumer 0's maximum, blocks up to 2t
        for h in T.Parallel(HB):
            m_blk[h] = T.max(mx_s[0, h], m_blk[h] * c)
            mx_s[1, h] = m_blk[h]
        T.named_barrier_arrive(_BAR_M1, 256)  # consumer 0 rescales block 2t's P to this maximum
        seesaw_softmax(c, acc_s, acc_o, m_i, m_blk, alpha, l_i, rowsum)
        T.copy(acc_s, p_reg)
        T.wgmma_gemm(p_reg, stages[1][1][0], acc_o)
        # P for consumer 0 converted again from acc_s: p_reg is the A operand of the MMA in flight, and PTX
        # leaves reading it before the wait undefined (storing p_reg measured no faster, within +-1%)
        T.copy(acc_s, P1_s)
        T.fence_proxy_async()
        T.named_barrier_arrive(_BAR_S1, 256)
        T.wait_wgmma(0)
        T.barrier_arrive(free[1][1][0])  # block 2t+1's right half, released before waiting for block 2t's P
        T.sync_threads(_BAR_S0, 256)  # block 2t's P, at the same maximum
        T.wgmma_gemm(P0_s, stages[0][1][0], acc_o)
        T.wait_wgmma(0)
        T.barrier_arrive(free[0][1][0])  # block 2t's right half (and P0 in its tail)

    @T.macro
    def stage_q_tma(Q, bz, qrow, h0, Q_l, Q_r, Q_t, bar_q):
        # one TMA per part of the row's Q block (rows past H fall outside the tensor: zeros); Q is read
        # once, so it need not stay in L2 beside the gathered rows
        T.tma_copy(Q[bz, qrow, h0 : h0 + HB, 0:D_half], Q_l, barrier=bar_q, eviction_policy="evict_first")
        T.tma_copy(Q[bz, qrow, h0 : h0 + HB, D_half:dim_v], Q_r, barrier=bar_q, eviction_policy="evict_first")
        if D_tail > 0:
            T.tma_copy(Q[bz, qrow, h0 : h0 + HB, dim_v:dim_qk], Q_t, barrier=bar_q, eviction_policy="evict_first")
        if T.shuffle_elect(256):
            T.barrier_arrive(bar_q)
        T.mbarrier_wait_parity(bar_q, 0)

    @T.macro
    def stage_q(Q, bz, qrow, h0, Q_l, Q_r, Q_t):
        # the consumers stage the row's Q block in shared memory (rows past H read as zero)
        for hh, d in T.Parallel(HB, D_half):
            Q_l[hh, d] = T.if_then_else(h0 + hh < H, Q[bz, qrow, h0 + hh, d], T.cast(0, dtype))
            Q_r[hh, d] = T.if_then_else(h0 + hh < H, Q[bz, qrow, h0 + hh, D_half + d], T.cast(0, dtype))
        if D_tail > 0:
            for hh, d in T.Parallel(HB, D_tail):
                Q_t[hh, d] = T.if_then_else(h0 + hh < H, Q[bz, qrow, h0 + hh, dim_v + d], T.cast(0, dtype))
        T.fence_proxy_async()
        T.sync_threads(_BAR_Q, 256)

    @T.macro
    def rows_consumer0(c, Q_l, Q_r, Q_t, stages, valid, acc_s0, acc_o0, m_i0, m_loc0, alpha0, l_i0, rs0, x_s, l_s,
                       P_s, bar_ready, bar_free, n_trips, base, Sinks, Output, Lse, bz, by, h0, cl=None):
        # consumer 0 of the qk_one / split schedules over one row block; base as in producer
        T.fill(acc_o0, 0)
        T.fill(l_i0, 0)
        T.fill(m_i0, neg_big)
        for t in T.serial(n_trips):
            for st in (0, 1):
                kv_l, kv_r, kt = stages[st]
                T.barrier_wait(bar_ready[st][0], (base + t) & 1)
                T.fence_proxy_async()
                if split:
                    split_stage(0, c, Q_l, Q_r, Q_t, kv_l, kv_r, kt, valid[st], acc_s0, acc_o0, m_i0,
                                m_loc0, alpha0, l_i0, rs0, x_s, P_s)
                else:
                    softmax_stage(c, Q_l, Q_r, Q_t, kv_l, kv_r, kt, valid[st], acc_s0, acc_o0,
                                  m_i0, m_loc0, alpha0, l_i0, rs0, x_s, P_s, t > 0 if st == 0 else True,
                                  bar_free[1 - st], t > 0 if st == 0 else True)
                if not async_pv:
                    T.barrier_arrive(bar_free[st][0])
        if async_pv:
            T.wait_wgmma(0)
            T.barrier_arrive(bar_free[1][0])
        # row sums of both halves ("split") or of consumer 0 alone
        for h in T.Parallel(HB):
            l_s[0, h] = l_i0[h]
        if not split:
            for h in T.Parallel(HB):
                l_s[1, h] = m_i0[h]
        T.sync_threads(_BAR_FIN, 256)
        for h in T.Parallel(HB):
            rs0[h] = l_s[0, h] + l_s[1, h] if split else l_s[0, h]
        finish(0, c, rs0, m_i0, alpha0, acc_o0, Q_l, Sinks, Output, Lse, bz, by, h0, stages=stages, cl=cl)

    @T.macro
    def rows_consumer1(c, Q_l, Q_r, Q_t, stages, valid, acc_s1, acc_o1, m_i1, m_loc1, alpha1, l_i1, rs1, x_s, l_s,
                       P_s, bar_ready, bar_free, n_trips, base, Sinks, Output, Lse, bz, by, h0, cl=None):
        # consumer 1 of the qk_one / split schedules over one row block
        T.fill(acc_o1, 0)
        if split:
            T.fill(l_i1, 0)
            T.fill(m_i1, neg_big)
        for t in T.serial(n_trips):
            for st in (0, 1):
                kv_l, kv_r, kt = stages[st]
                T.barrier_wait(bar_ready[st][0], (base + t) & 1)
                T.fence_proxy_async()
                if split:
                    split_stage(1, c, Q_l, Q_r, Q_t, kv_l, kv_r, kt, valid[st], acc_s1, acc_o1, m_i1,
                                m_loc1, alpha1, l_i1, rs1, x_s, P_s)
                else:
                    pv_stage(kv_r, acc_o1, x_s, P_s, t + 1 < n_trips if st == 1 else True)
                T.barrier_arrive(bar_free[st][0])
        if split:
            for h in T.Parallel(HB):
                l_s[1, h] = l_i1[h]
        T.sync_threads(_BAR_FIN, 256)
        if split:
            for h in T.Parallel(HB):
                rs1[h] = l_s[0, h] + l_s[1, h]
        else:
            for h in T.Parallel(HB):
                rs1[h] = l_s[0, h]
                m_i1[h] = l_s[1, h]
        finish(1, c, rs1, m_i1, alpha1, acc_o1, Q_r, Sinks, Output, Lse, bz, by, h0, stages=stages, cl=cl)

    @T.macro
    def next_row_block(cur, RowTrips, bx, i):
        # persistent: row block bx + i * G decoded once into registers (first head, query row, batch,
        # trips); as let-bound values the divisions would be inlined at every use
        cur[0] = bx + i * persistent_ctas
        cur[1] = (cur[0] // T.ceildiv(H, HB)) % SO
        cur[2] = cur[0] // T.ceildiv(H, HB) // SO
        cur[0] = (cur[0] % T.ceildiv(H, HB)) * HB
        cur[3] = RowTrips[cur[2], cur[1]] if skip_tail else KP // (2 * BK)

    n_blk = 2 if split else 1
    prelude = "".join(([_FWD_PRELUDE] if hint else [])
                      + ([_CLUSTER_PRELUDE] if cluster_parts else [CLUSTER_PRELUDE] if cluster else [])
                      + ([_ex2.PRELUDE] if fast_exp2 else [])) or None
    cluster_dims = (1, cluster_parts, 1) if cluster_parts else _CLUSTER_DIMS[cluster]
    grid = (persistent_ctas, 1, 1) if persistent_ctas else (T.ceildiv(H, HB), SO, B)

    @T.prim_func
    def main(
        Q: T.Tensor([B, S, H, dim_qk], dtype),
        KV: T.Tensor([B, SKV, dim_qk], dtype),
        Indices: T.Tensor([B, SO, KP], "int32"),
        Sinks: T.Tensor([H], accum),
        scale: T.float32,
        Output: T.Tensor([B, S if cluster_parts else SO, H, dim_v], out_dtype),
        Lse: T.Tensor([B, S if cluster_parts else SO, H], accum),
        RowTrips: T.Tensor([B, SO] if skip_tail else [1], "int32"),  # trips of 2 * BK slots per row
    ):
        with T.Kernel(*grid, threads=384, prelude=prelude, cluster_dims=cluster_dims) as (bx, by, bz):
            Q_l = T.alloc_shared([HB, D_half], dtype)
            Q_r = T.alloc_shared([HB, D_half], dtype)
            Q_t = T.alloc_shared([HB, D_tail], dtype) if D_tail > 0 else None
            stages = []
            for _st in (0, 1):
                kv_l = [T.alloc_shared([ROWS_BUF, D_half], dtype) for _b in range(n_blk)]
                kv_r = [T.alloc_shared([ROWS_BUF, D_half], dtype) for _b in range(n_blk)]
                kt = [T.alloc_shared([ROWS_BUF, D_tail], dtype) for _b in range(n_blk)] if D_tail > 0 else None
                stages.append((kv_l, kv_r, kt))
            if seesaw:
                # each block's P (at the maximum after both blocks) for the other consumer. P of
                # block 2t sits in its stage's score-only tail when that is one P tile wide (the
                # scores are done with it, and that half is released after consumer 1's P @ V);
                # block 2t+1's right half is released earlier, so its P has a buffer of its own
                P_s = [stages[0][2][0] if D_tail == BK else T.alloc_shared([HB, BK], dtype),
                       T.alloc_shared([HB, BK], dtype)]
                p_reg0 = T.alloc_fragment([HB, BK], dtype)
                p_reg1 = T.alloc_fragment([HB, BK], dtype)
            else:
                P_s = [T.alloc_shared([HB, ROWS_BUF], dtype) for _b in range(n_blk)]
            valid = [T.alloc_shared([BK], "int32"), T.alloc_shared([BK], "int32")]
            x_s = T.alloc_shared([2, HB], accum)  # row max exchange ("split")
            l_s = T.alloc_shared([2, HB], accum)  # row sums / final factors
            idx_reg = T.alloc_local([PASSES], "int32")

            acc_s0 = T.alloc_fragment([HB, ROWS_BUF], accum)
            acc_s1 = T.alloc_fragment([HB, ROWS_BUF], accum)
            acc_o0 = T.alloc_fragment([HB, D_half], accum)
            acc_o1 = T.alloc_fragment([HB, D_half], accum)
            m_i0 = T.alloc_fragment([HB], accum)
            m_i1 = T.alloc_fragment([HB], accum)
            m_loc0 = T.alloc_fragment([HB], accum)
            m_loc1 = T.alloc_fragment([HB], accum)
            alpha0 = T.alloc_fragment([HB], accum)
            alpha1 = T.alloc_fragment([HB], accum)
            l_i0 = T.alloc_fragment([HB], accum)
            l_i1 = T.alloc_fragment([HB], accum)
            rs0 = T.alloc_fragment([HB], accum)
            rs1 = T.alloc_fragment([HB], accum)

            if seesaw:
                # [stage][half]: ready = 128 producer threads x (cp.async completion + arrive);
                # free = the one consumer that reads the half last
                bar_ready = [[T.alloc_barrier(256), T.alloc_barrier(256)], [T.alloc_barrier(256), T.alloc_barrier(256)]]
                bar_free = [[T.alloc_barrier(128), T.alloc_barrier(128)], [T.alloc_barrier(128), T.alloc_barrier(128)]]
                idx_reg1 = T.alloc_local([PASSES], "int32")
            else:
                bar_ready = [T.alloc_barrier(256), T.alloc_barrier(256)]
                bar_free = [T.alloc_barrier(256), T.alloc_barrier(256)]
            bar_q = T.alloc_barrier(1) if tma_io else None
            # cluster_parts: each head's log2-sum-exp of this part (read by the peers), and the merge's locals
            cl = (T.alloc_shared([HB], accum), T.alloc_local([P], accum), T.alloc_local([8], accum),
                  T.alloc_local([3], accum), T.alloc_local([P * 8], "uint32")) if cluster_parts else None

            tx = T.get_thread_binding()
            h0 = bx * HB
            if cluster_dims is not None:
                T.call_extern("handle", "dsa_grid_dependency_wait")  # before the first global read (cluster.py)
            # skip_tail: trips past the row's last valid slot hold only -1; every warpgroup reads
            # the same count, so the barriers stay paired
            n_trips = RowTrips[bz, by] if skip_tail else KP // (2 * BK)
            qrow = by // (SO // S) if partial else (by // P if cluster_parts else by)
            c = scale * _LOG2E

            if persistent_ctas:
                # CTA bx walks the row blocks bx, bx + G, ... (head block fastest, as in the plain grid);
                # the producer runs ahead into the next row block's first stages while the consumers
                # write the output of the last one and stage the next Q
                n_rows = T.ceildiv(H, HB) * SO * B
                n_mine = T.if_then_else(bx < n_rows, (n_rows - bx + persistent_ctas - 1) // persistent_ctas, 0)
                base = T.alloc_local([1], "int32")  # trips of the earlier row blocks: barrier phases
                base[0] = 0
                cur = T.alloc_local([4], "int32")  # the row block: first head, query row, batch, trips

                if tx >= 256:
                    T.set_max_nreg(producer_regs, 0)
                    for i in T.serial(n_mine):
                        next_row_block(cur, RowTrips, bx, i)
                        producer(Indices, KV, cur[2], cur[1], cur[3], idx_reg, stages, valid, bar_ready, bar_free,
                                 tx - 256, base[0])
                        base[0] = base[0] + cur[3]
                else:
                    if tx < 128:
                        T.set_max_nreg(consumer_regs[0], 1)
                    else:
                        T.set_max_nreg(consumer_regs[1], 1)
                    for i in T.serial(n_mine):
                        next_row_block(cur, RowTrips, bx, i)
                        T.sync_threads(_BAR_NEXT, 256)  # the last row block's output left Q_l / Q_r
                        stage_q(Q, cur[2], cur[1], cur[0], Q_l, Q_r, Q_t)
                        if tx < 128:
                            rows_consumer0(c, Q_l, Q_r, Q_t, stages, valid, acc_s0, acc_o0, m_i0, m_loc0, alpha0, l_i0,
                                           rs0, x_s, l_s, P_s, bar_ready, bar_free, cur[3], base[0], Sinks, Output,
                                           Lse, cur[2], cur[1], cur[0])
                        else:
                            rows_consumer1(c, Q_l, Q_r, Q_t, stages, valid, acc_s1, acc_o1, m_i1, m_loc1, alpha1, l_i1,
                                           rs1, x_s, l_s, P_s, bar_ready, bar_free, cur[3], base[0], Sinks, Output,
                                           Lse, cur[2], cur[1], cur[0])
                        base[0] = base[0] + cur[3]
            elif tx >= 256:
                T.set_max_nreg(producer_regs, 0)
                if seesaw:
                    seesaw_producer(Indices, KV, bz, by, n_trips, idx_reg, idx_reg1, stages, valid, bar_ready,
                                    bar_free, tx - 256)
                else:
                    producer(Indices, KV, bz, by, n_trips, idx_reg, stages, valid, bar_ready, bar_free, tx - 256, 0)
                if cluster_parts:  # every thread of the cluster takes part in the consumers' two barriers
                    T.call_extern("handle", "dsa_cluster_sync")
                    T.call_extern("handle", "dsa_cluster_sync")
            else:
                if tma_io:
                    stage_q_tma(Q, bz, qrow, h0, Q_l, Q_r, Q_t, bar_q)
                else:
                    stage_q(Q, bz, qrow, h0, Q_l, Q_r, Q_t)

                if seesaw and tx < 128:
                    T.set_max_nreg(consumer_regs[0], 1)
                    T.fill(acc_o0, 0)
                    T.fill(l_i0, 0)
                    T.fill(m_i0, neg_big)
                    if n_trips > 0:  # the first block's scores; each trip issues the next one's
                        seesaw_scores(Q_l, Q_r, Q_t, stages[0], bar_ready, 0, 0, acc_s0)
                    for t in T.serial(n_trips):
                        seesaw_even(c, Q_l, Q_r, Q_t, stages, valid, P_s[0], P_s[1], x_s, acc_s0, p_reg0, acc_o0,
                                    m_i0, m_loc0, alpha0, l_i0, rs0, bar_ready, bar_free, t, n_trips)
                    for h in T.Parallel(HB):
                        l_s[0, h] = l_i0[h]
                    T.sync_threads(_BAR_FIN, 256)
                    for h in T.Parallel(HB):
                        rs0[h] = l_s[0, h] + l_s[1, h]
                    finish(0, c, rs0, m_i0, alpha0, acc_o0, Q_l, Sinks, Output, Lse, bz, by, h0, m_scaled=True,
                           stages=stages, cl=cl)
                elif seesaw:
                    T.set_max_nreg(consumer_regs[1], 1)
                    T.fill(acc_o1, 0)
                    T.fill(l_i1, 0)
                    T.fill(m_i1, neg_big)
                    for t in T.serial(n_trips):
                        seesaw_odd(c, Q_l, Q_r, Q_t, stages, valid, P_s[0], P_s[1], x_s, acc_s1, p_reg1, acc_o1,
                                   m_i1, m_loc1, alpha1, l_i1, rs1, bar_ready, bar_free, t)
                    for h in T.Parallel(HB):
                        l_s[1, h] = l_i1[h]
                    T.sync_threads(_BAR_FIN, 256)
                    for h in T.Parallel(HB):
                        rs1[h] = l_s[0, h] + l_s[1, h]
                    finish(1, c, rs1, m_i1, alpha1, acc_o1, Q_r, Sinks, Output, Lse, bz, by, h0, m_scaled=True,
                           stages=stages, cl=cl)
                elif tx < 128:
                    T.set_max_nreg(consumer_regs[0], 1)
                    rows_consumer0(c, Q_l, Q_r, Q_t, stages, valid, acc_s0, acc_o0, m_i0, m_loc0, alpha0, l_i0, rs0,
                                   x_s, l_s, P_s, bar_ready, bar_free, n_trips, 0, Sinks, Output, Lse, bz, by, h0, cl)
                else:
                    T.set_max_nreg(consumer_regs[1], 1)
                    rows_consumer1(c, Q_l, Q_r, Q_t, stages, valid, acc_s1, acc_o1, m_i1, m_loc1, alpha1, l_i1, rs1,
                                   x_s, l_s, P_s, bar_ready, bar_free, n_trips, 0, Sinks, Output, Lse, bz, by, h0, cl)

    return main


@functools.lru_cache(maxsize=None)
def _jit_for_target(target_key: str, auto_sync: bool = True):
    import tilelang

    target = _target_from_key(target_key)
    return tilelang.jit(
        target=target,
        pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False,
                      tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: not auto_sync},
        compile_flags=["-O3", "-DNDEBUG", "--ptxas-options=--register-usage-level=10"],
    )(_program)


def _target_key(target) -> str:
    if isinstance(target, dict):
        return "dict:" + ",".join(f"{k}={target[k]}" for k in sorted(target))
    return "str:" + str(target)


def _target_from_key(key: str):
    kind, _, rest = key.partition(":")
    if kind == "dict":
        return dict(item.split("=", 1) for item in rest.split(",") if item)
    return rest


_build_lock = threading.Lock()
_kernels: dict = {}


def build_fwd_kernel(config: dict, target="auto"):
    """Compile (or fetch from the cache) the program of ``config`` for ``target``.

    ``target`` is "auto" (the local GPU), "cuda", or a dict such as {"kind": "cuda", "arch": "sm_90a"}
    (compiles without a GPU). Returns TileLang's JITKernel, called as
    kernel(q, kv, indices_padded, sinks, scale, out, lse, row_trips) (it writes out and lse;
    row_trips [B, S] int32 with ``skip_tail``, else a one-element placeholder).
    """
    cfg = _normalise_config(config)
    tkey = _target_key(target)
    key = (tkey,) + tuple(cfg[k] for k in _COMPILE_KEYS)

    def build():
        kernel = _jit_for_target(tkey, cfg["auto_sync"])(**cfg)
        logger.info(
            "compiled sparse_attention_fwd Dqk=%d Dv=%d sink=%s %s block_h=%d block_k=%d schedule=%s for %s",
            cfg["dim_qk"], cfg["dim_v"], cfg["has_sink"], cfg["dtype"], cfg["block_h"], cfg["block_k"],
            cfg["schedule"],
            tkey.partition(":")[2],
        )
        return kernel

    return compiled_once(_kernels, _build_lock, key, "sparse attention forward", build)


def _combine_program(dim_v, has_sink, dtype):
    """Merges the partial program's outputs: per (row, head), the parts' fp32 outputs weighted by
    exp(lse_p - max), the sink (if any) added to the normaliser. Parts without a valid slot
    (lse +inf) weigh nothing; a row without any gives out 0 and lse +inf; NaN propagates."""
    import tilelang.language as T

    B, S, P, H = T.dynamic("batch, seqlen, parts, heads")
    threads = 128
    per_thread = (dim_v + threads - 1) // threads
    f32 = "float32"

    @T.prim_func
    def main(
        OPart: T.Tensor([B, S, P, H, dim_v], f32),
        LPart: T.Tensor([B, S, P, H], f32),
        Sinks: T.Tensor([H], f32),
        Output: T.Tensor([B, S, H, dim_v], dtype),
        Lse: T.Tensor([B, S, H], f32),
    ):
        with T.Kernel(H, S, B, threads=threads) as (h, s, b):
            tx = T.get_thread_binding()
            m = T.alloc_local([1], f32)
            tot = T.alloc_local([1], f32)
            w = T.alloc_local([1], f32)
            acc = T.alloc_local([per_thread], f32)
            m[0] = -T.infinity(f32)
            for p in T.serial(P):
                if LPart[b, s, p, h] < T.infinity(f32):
                    m[0] = T.max(m[0], LPart[b, s, p, h])
            tot[0] = 0.0
            for j in T.serial(per_thread):
                acc[j] = 0.0
            for p in T.serial(P):
                w[0] = T.if_then_else(LPart[b, s, p, h] == T.infinity(f32), 0.0, T.exp(LPart[b, s, p, h] - m[0]))
                tot[0] += w[0]
                for j in T.serial(per_thread):
                    if j * threads + tx < dim_v:
                        acc[j] += w[0] * OPart[b, s, p, h, j * threads + tx]
            if has_sink:
                w[0] = T.if_then_else(tot[0] != 0, 1.0 / (tot[0] + T.exp(Sinks[h] - m[0])), 0.0)
            else:
                w[0] = T.if_then_else(tot[0] != 0, 1.0 / tot[0], 0.0)
            for j in T.serial(per_thread):
                if j * threads + tx < dim_v:
                    Output[b, s, h, j * threads + tx] = T.cast(acc[j] * w[0], dtype)
            if tx == 0:
                Lse[b, s, h] = T.if_then_else(tot[0] != 0, m[0] + T.log(tot[0]), T.infinity(f32))

    return main


_combine_kernels: dict = {}


def build_combine_kernel(dim_v: int, has_sink: bool, dtype: str = "bfloat16", target="auto"):
    """Compile (or fetch) the combine program of the decode path; called as
    kernel(out_parts [B,S,P,H,dv] fp32, lse_parts [B,S,P,H] fp32, sinks [H] fp32, out, lse)."""
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
    tkey = _target_key(target)
    key = (tkey, int(dim_v), bool(has_sink), dtype)

    def build():
        import tilelang

        return tilelang.jit(
            target=_target_from_key(tkey),
            pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
        )(_combine_program)(int(dim_v), bool(has_sink), dtype)

    return compiled_once(_combine_kernels, _build_lock, key, "sparse attention forward (decode combine)", build)


def config_for(dim_qk: int, dim_v: int, has_sink: bool, dtype: torch.dtype, overrides: dict | None = None) -> dict:
    """The configuration the wrapper uses for these inputs, with ``overrides`` (compile-time keys) on top.

    The overrides are merged before the defaults that depend on other keys are filled in, so that
    {"schedule": "seesaw"} gets the seesaw's register budgets, not the default schedule's."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"q must be bfloat16 or float16, got {str(dtype).replace('torch.', '')}")
    return _normalise_config(
        {**DEFAULT_CONFIG, "dim_qk": int(dim_qk), "dim_v": int(dim_v), "has_sink": bool(has_sink),
         "dtype": _DTYPE_NAMES[dtype], **(overrides or {})}
    )


def unsupported_reason(num_heads: int, dqk: int, dv: int, has_sink: bool, dtype: torch.dtype) -> str | None:
    """None when the kernel family runs this configuration, else a one-line reason (the ops layer
    falls back to the reference under backend="auto" and raises under "tilelang")."""
    try:
        config_for(dqk, dv, has_sink, dtype)
    except ValueError as exc:
        return str(exc)
    return None


@functools.lru_cache(maxsize=None)
def device_target(index: int) -> dict:
    """The explicit TileLang target of CUDA device ``index`` (same key as a CPU build for sm_90a)."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        raise RuntimeError(
            f"sparse_attention_fwd: the TileLang kernel needs a Hopper GPU (sm_90: wgmma, setmaxnreg); "
            f"{torch.cuda.get_device_name(index)} is sm_{major}{minor}"
        )
    return {"kind": "cuda", "arch": "sm_90a"}


def _check_inputs(q, kv, indices, scale, sink, dv):
    check_tensor("q", q, ndim=4, dtypes=tuple(_DTYPE_NAMES))
    b, s, h, dqk = q.shape
    check_tensor("kv", kv, ndim=3, dtypes=(q.dtype,), device=q.device, shape={0: b, 2: dqk})
    check_tensor("indices", indices, ndim=3, dtypes=(torch.int32, torch.int64), device=q.device,
                 shape={0: b, 1: s})
    scale = check_scale(scale)
    dv = dqk if dv is None else int(dv)
    if not 0 < dv <= dqk:
        raise ValueError(f"dv must be in (0, Dqk={dqk}], got {dv}")
    if sink is not None:
        check_tensor("sink", sink, ndim=1, dtypes=(torch.float32,), device=q.device, shape={0: h})
    if indices.shape[-1] < 1:
        raise ValueError(f"indices must have at least one slot (K >= 1), got shape {tuple(indices.shape)}")
    if q.device.type != "cuda":
        raise ValueError(f"q must be a CUDA tensor, got a tensor on {q.device}")
    return scale, dv


# Decode (one query per row). A lone row's CTA walks its slots at about 4 us per 128 on an H100 however idle
# the GPU is (B 1, k 2048: 16 trips, 70 us), so the rows of small batches are cut into parts, each scored by a
# CTA of its own. By default (decode_cluster_parts) the parts of a row form one cluster and merge through
# distributed shared memory (cluster_parts; rows of up to 64 heads in two parts: 1.6x at B 1-32 and 1.07x at
# B 64 on an H100). With DSA_PLUGINS_DECODE_PART_SLOTS = n > 0 they are parts of n slots that write fp32
# partials merged by the combine program instead (off by default: large batches lose to the partials'
# traffic). Either way the part count depends on k and the heads only, never on the batch: a row's result is
# the same bits however the rows are batched.


def _launch(q, kv, indices, scale: float, sink, dv: int, out: torch.Tensor, lse: torch.Tensor,
            overrides: dict | None = None, part_slots: int | None = None, cluster_parts: int | None = None,
            decode: bool | None = None) -> None:
    """Normalise the (checked) inputs once and run the program, writing ``out`` and ``lse``.

    ``overrides`` replaces compile-time parameters of the default configuration (tests, tuning);
    ``part_slots`` the decode split through HBM partials (None: DSA_PLUGINS_DECODE_PART_SLOTS for one-query
    rows, 0: off); ``cluster_parts`` the decode split merged inside a cluster (None: decode_cluster_parts(k, H)
    for one-query rows when part_slots is off, 0: off; an override's cluster_parts is taken as this argument).
    ``decode``: whether the rows are generation steps that the splits apply to (None: one query row, S == 1;
    the ops layer passes its whole input's answer, so a one-row tail block of a chunked prefill is not split)."""
    b, s, h, dqk = q.shape
    k = indices.shape[-1]
    if b == 0 or s == 0 or h == 0:
        return
    if kv.shape[1] == 0:
        out.zero_()
        lse.fill_(math.inf)
        return
    if overrides:
        overrides = dict(overrides)
        if overrides.get("cluster_parts") and cluster_parts is None:  # the split is the wrapper's to lay out
            cluster_parts = overrides["cluster_parts"]
        overrides.pop("cluster_parts", None)
    decode = s == 1 if decode is None else bool(decode)
    if part_slots is None:
        part_slots = decode_part_slots() if decode else 0
    given = dict(overrides or {})
    # the programs that cut a row into parts exist for PARTS_SCHEDULE only: unless a schedule is named, rows cut
    # into parts take it, and whole rows (prefill, or generation steps left whole) the default
    parts_overrides = given if "schedule" in given else {**given, "schedule": PARTS_SCHEDULE}
    if cluster_parts is None:
        split_ok = decode and not part_slots and _takes_cluster_parts(
            config_for(dqk, dv, sink is not None, q.dtype, parts_overrides))
        cluster_parts = decode_cluster_parts(k, h) if split_ok else 0
    if cluster_parts:
        parts = cluster_parts
    else:
        parts = -(-k // part_slots) if part_slots and k > part_slots else 1
    cfg = config_for(dqk, dv, sink is not None, q.dtype, parts_overrides if parts > 1 else given)
    step = 2 * cfg["block_k"]
    kp = -(-(-(-k // parts)) // step) * step * parts  # each part a whole number of trips
    # (the HBM split's fp32 partials hold parts outputs; the cluster split none). kv is not bounded: its
    # gathers are addressed in 64 bits (test_sparse_attention_fwd_compile holds it), and a generation step
    # over many long caches (B 32 x 128K x 576 elements) is one launch
    if max(q.numel(), out.numel() * (1 if cluster_parts else parts), b * s * kp) >= 2**31:
        raise ValueError("sparse_attention_fwd: q, out and indices of 2**31 or more elements are not supported")
    device_index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    target = device_target(device_index)
    q, kv = aligned_operand(q), aligned_operand(kv)
    idx = as_int32(indices, kv.shape[1])
    if kp != k:
        idx = torch.nn.functional.pad(idx, (0, kp - k), value=-1)
    idx = idx.contiguous()
    sinks = sink.contiguous() if sink is not None else unread_arg(h, torch.float32, q.device)  # has_sink off
    rows = s * parts  # part p of a row is row s * parts + p of the partial program
    if (cfg["cluster"] == "heads" and -(-h // cfg["block_h"]) % 2) or (cfg["cluster"] == "rows" and rows % 2):
        raise ValueError(f"cluster={cfg['cluster']!r} needs an even number of head blocks / query rows, got "
                         f"{h} heads and {rows} rows")
    with torch.cuda.device(q.device):
        if cfg["skip_tail"] and s == 1:
            # one-query rows (decode) walk every trip: their caches are rarely shorter than k, and counting
            # them cost ~15 us of an 85 us step when it took nine small launches (H100, CUDA graph); the full
            # walk gives the same bits (masked trips add nothing). A fill per call, not a cached tensor: one
            # first made inside torch.compile's CUDA-graph warm-up would stay in its pool
            trips = torch.full((b, rows), kp // parts // step, dtype=torch.int32, device=q.device)
        elif cfg["skip_tail"]:  # one launch (entries past the keys count as valid: they only add masked trips)
            trips = row_blocks_cuda(idx.view(b * rows, kp // parts), step, target).view(b, rows)
        else:
            trips = zeros_arg(1, torch.int32, q.device)
        if parts == 1:
            # the output leaves by TMA: write a misaligned ``out`` (a view at an odd element offset) through
            # an aligned buffer
            dst = aligned_output(out) if cfg["tma_io"] else out
            build_fwd_kernel(cfg, target=target)(q, kv, idx, sinks, scale, dst, lse, trips)
            if dst is not out:
                out.copy_(dst)
            return
        if cluster_parts:
            # the parts of a row merge inside their cluster and write out and lse themselves
            build_fwd_kernel({**cfg, "cluster_parts": cluster_parts}, target=target)(
                q, kv, idx.view(b, rows, kp // parts), sinks, scale, out, lse, trips)
            return
        partial = build_fwd_kernel({**cfg, "has_sink": False, "partial": True}, target=target)
        o_part = torch.empty(b, rows, h, dv, dtype=torch.float32, device=q.device)
        l_part = torch.empty(b, rows, h, dtype=torch.float32, device=q.device)
        partial(q, kv, idx.view(b, rows, kp // parts), zeros_arg(h, torch.float32, q.device), scale, o_part,
                l_part, trips)
        combine = build_combine_kernel(dv, sink is not None, cfg["dtype"], target=target)
        combine(o_part.view(b, s, parts, h, dv), l_part.view(b, s, parts, h), sinks, out, lse)


def sparse_attention_fwd(q, kv, indices, scale: float, sink=None, dv: int | None = None, *, out=None, lse=None,
                         decode: bool | None = None):
    """Sparse attention forward with the TileLang kernel.

    q [B, S, H, Dqk] bf16/fp16 CUDA; kv [B, Skv, Dqk] same dtype; indices [B, S, K] int32 (int64 is
    converted), any K >= 1, entries < 0 or >= Skv mean "no key" and are never read; sink [H] float32
    or None; dv defaults to Dqk, V = kv[..., :dv]. Dqk - dv must be a multiple of 16, dv of 32.
    Returns out [B, S, H, dv] in q.dtype and lse [B, S, H] float32 (natural log, sink excluded;
    +inf with out = 0 for rows without a valid index).

    ``out`` / ``lse`` (contiguous, those shapes and dtypes) are written in place of new tensors: the
    ops layer hands in views of one buffer when it runs long inputs in chunks, so nothing is
    concatenated afterwards (a second copy of the output at 64K tokens x 64 heads is 4 GiB).

    ``decode`` (None: S == 1): the rows are generation steps, cut into parts on CTAs of their own (a function of
    k and H only: the same bits in any batch); a caller running blocks of a longer input passes False.
    """
    scale, dv = _check_inputs(q, kv, indices, scale, sink, dv)
    b, s, h, _ = q.shape
    out = output_buffer("out", out, (b, s, h, dv), q.dtype, q.device)
    lse = output_buffer("lse", lse, (b, s, h), torch.float32, q.device)
    _launch(q, kv, indices, scale, sink, dv, out, lse, decode=decode)
    return out, lse
