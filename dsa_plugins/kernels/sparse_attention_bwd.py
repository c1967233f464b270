"""TileLang backward of DeepSeek sparse attention over a shared latent (DSA.md section 1.1).

One kernel family built from compile-time parameters (heads, dims, block sizes, dtype,
deterministic flag); the query-row count, the kv-row count and the padded top-k are dynamic, so new
lengths reuse the compiled program, and the scale is a run-time argument.

Programs (all compiled per configuration by :func:`build_bwd_kernels`):

* ``preprocess``: Delta[t, h] = <out[t, h], dout[t, h]> in fp32 and the effective log-sum-exp in
  base 2 (with a sink: logaddexp(lse, z_h); +inf stays +inf, so rows without a key give P = 0).
* ``ws`` (the atomic mode's program where dv is a multiple of 128 and dqk - dv is 0 or 64: every
  model shape): warp-specialised, see :func:`_ws_body`. H100, B1 S4096 Skv8192: MLA 576/512 k2048
  H64 352 TFLOP/s (8.39 ms), H128 358; V4 D512 sink H128 k1024 330-338; 1.31-1.38x the plain program,
  0.80-0.84x cuDNN frontend 1.32's sm90 backward in the same run (``benchmarks/results/bwd_ws_h100.md``).
  Each CTA walks its row's slot blocks only to the last valid slot (``skip_tail``, found by the CTA itself):
  causal rows 1.19-1.24x, full rows unchanged.
  The opt-in deterministic mode ``det_mode`` "fixed" sends fixed-point values instead: each dkv value
  times a power of two chosen from the inputs' magnitudes, rounded to int64 and added with integer
  reductions, whose sums do not depend on the order of the additions (see :func:`_fixed_point_scale`);
  measured 4.3-4.8x the atomic time on an H100 (L2 adds 64-bit integers ~7x slower per value than
  fp32 red.v4), so the deterministic mode stores per-slot contribution rows instead, for the reduce
  to sum: by default (``det_mode`` "contrib_i16") as int16 with a power of two per 8 values (1.66x the
  atomic time at MLA H64, 1.46x at V4 H128; dkv within 5e-5 of the fp32 sums); "contrib_ws" stores fp32 (the
  same sums: 2.0x), "contrib_bf16" bf16 (1.55x / 1.29x, within 1.7e-3: about a bf16 rounding) and "contrib"
  has the plain program write fp32 rows (2.35x). H100, B1 S4096 Skv8192 (``bwd_ws_h100.md``).
* ``main`` (the plain program: other head dims, the "contrib" deterministic mode, tuning experiments): one CTA of
  256 threads per (query row, block of 64 heads); heads beyond H are padded inside the CTA (zero q / dout, lse = +inf: they contribute
  nothing). The CTA walks the top-k slots in blocks of 64: gathers the selected kv rows with
  cp.async (invalid slots zero-filled, never read; the next block's gather overlaps the dkv part),
  recomputes P from the lse, forms dS = P * (dP - Delta) in registers, accumulates dq in
  registers, and adds dS^T q + P^T dout (all MMAs on wgmma) into a zero-initialised fp32 dkv with
  red.global.add.v2.f32 straight from the accumulators. ``overlap`` (off by default, measured no
  faster) runs the MMAs of the next dkv column chunk while the atomics of the current one issue.
* ``reduce`` (the deterministic contribution modes): sums each kv row's per-slot contributions in a fixed
  order (one CTA per kv row, its warps taking slots in turn, then combined in warp order); the slot order
  is sorted on a side stream while the main program runs. Both live in :mod:`.contrib_reduce` (the indexer
  loss's deterministic d_index_k uses them too).

Everything is flattened over the batch: query rows t = b * S + s, kv rows n = b * Skv + j; the
wrapper rewrites the indices once to global rows (invalid -> -1) while padding k with -1.

The plain program measured on an H200 (bf16, B1 S4096 Skv8192, whole wrapper incl. preprocess and
dkv zeroing): absorbed MLA 576/512 k2048 H64 266 TFLOP/s (11.1 ms), H128 274 (21.6 ms); V4 D512
sink H128 k1024 268 (10.2 ms); TileLang's example: 190. The fp32 scatter-add into L2 bounds both
programs: full-line red.v4 (ws) takes 0.77 G adds/ms on an H100, the plain program's red.v2 0.51.

Size: one file for the backward family (preprocess, the ws and plain main programs with their atomic
and deterministic dkv paths, the config table and the wrapper); they share layouts and must stay in
step.
"""

import functools
import inspect
import json
import logging
import os
import threading

import torch
from torch import Tensor

from ..common.indices import global_rows, row_blocks
from ..common.settings import deterministic_mode, warn_once
from ..common.validation import output_buffer
from . import aligned_operand, aligned_output, compiled_once, target_key, zeros_arg
from .cluster import CLUSTER_PRELUDE
from . import fast_exp2 as _ex2
from .row_scan import ROW_SCAN_PRELUDE
from .contrib_reduce import DET_BUDGET_BYTES, build_reduce, chunk_rows, keys_last_invalid, slot_order_async

__all__ = ["BWD_PROGRAMS", "SHIPPED_CONFIGS", "build_bwd_kernels", "build_bwd_program", "bwd_flops", "bwd_program_names",
           "sparse_attention_bwd"]

logger = logging.getLogger("dsa_plugins")

_LOG2E = 1.4426950408889634
_BLOCK_H = 64

# Configurations compiled by the CPU test and shipped as supported. Keys: heads, dqk, dv,
# has_sink, dtype; optional tuning keys are filled by _normalise_config.
SHIPPED_CONFIGS: list[dict] = [
    {"heads": 64, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16"},  # DeepSeek-V4 Flash
    {"heads": 128, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16"},  # DeepSeek-V4
    {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"},  # GLM-5 absorbed MLA
    {"heads": 128, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"},  # V3.2 absorbed MLA
    {"heads": 16, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"},  # small head counts (TP shards)
    {"heads": 32, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16"},
]

# Byte budget of the deterministic contribution buffer (per launch chunk of query rows).
_DET_BUDGET_BYTES = DET_BUDGET_BYTES  # DSA_PLUGINS_BWD_DET_BUDGET_MB (contrib_reduce), patched by tests


def bwd_flops(num_queries: int, heads: int, topk: int, dqk: int, dv: int) -> float:
    """FLOPs of the backward, counted over all top-k slots (FlashMLA / TileLang convention)."""
    return 2.0 * num_queries * heads * topk * (2 * dv + 3 * dqk)


_TUNING_KEYS = ("block_k", "num_stages", "threads", "dkv_chunk", "stage_atomics", "overlap", "skip_tail", "l2_keep",
                "schedule", "ws_prefetch", "ws_dq_rs", "ws_pair", "ws_wg0_chunks", "ws_auto_sync", "det_mode",
                "fast_exp2", "det_store_pred", "det_pair", "ws_tma_q", "ws_fused_pre", "ws_dkv_perm",
                "ws_stage_dq", "ws_row_regs", "ws_tma_dq", "det_pair_perm")
_DET_MODES = ("contrib", "contrib_ws", "contrib_bf16", "contrib_i16", "fixed")
# the modes whose contribution rows the ws program stores
_CONTRIB_WS_MODES = ("contrib_ws", "contrib_bf16", "contrib_i16")
# the contribution modes whose rows are not fp32 (the same names as the ws program's det_out)
_CONTRIB_DTYPES = {"contrib_bf16": "bfloat16", "contrib_i16": "int16"}
_SCHEDULES = ("ws", "plain")


def _default_tuning(dqk: int, dv: int) -> dict:
    # Shared memory (bf16, 64 heads): q 64*dqk*2 + dout 64*dv*2 + kv 64*dqk*2 + P/dS 2*64*64*2
    # = 225 KiB for 576/512, under the 227 KiB of a Hopper block. block_k = 64 keeps every MMA on
    # wgmma (M = 64 for the dkv products); dkv atomics go out from registers (red.v2), measured
    # faster than staging through shared memory for red.v4 (268 vs 248 TFLOP/s, V4 H128).
    chunk = 64 if dv % 64 == 0 else 32 if dv % 32 == 0 else 16
    return {"block_k": 64, "num_stages": 1, "threads": 256, "dkv_chunk": chunk}


def _normalise_config(config: dict) -> dict:
    cfg = dict(config)
    env = os.environ.get("DSA_PLUGINS_BWD_TUNING")  # JSON overrides of the tuning keys (experiments)
    if env:
        cfg.update({k: v for k, v in json.loads(env).items() if k in _TUNING_KEYS})
    for key in ("heads", "dqk", "dv"):
        if key not in cfg:
            raise ValueError(f"bwd config needs {key!r}, got {config}")
    cfg["heads"], cfg["dqk"], cfg["dv"] = int(cfg["heads"]), int(cfg["dqk"]), int(cfg["dv"])
    cfg["has_sink"] = bool(cfg.get("has_sink", False))
    cfg["dtype"] = str(cfg.get("dtype", "bfloat16")).replace("torch.", "")
    if cfg["dtype"] not in ("bfloat16", "float16"):
        raise ValueError(f"dtype must be bfloat16 or float16, got {cfg['dtype']}")
    for k, v in _default_tuning(cfg["dqk"], cfg["dv"]).items():
        cfg[k] = int(cfg.get(k) or v)
    cfg["store_dkv"] = bool(cfg.get("store_dkv", True))  # False: benchmark ablation only
    cfg["stage_atomics"] = bool(cfg.get("stage_atomics", False))
    can_overlap = cfg["block_k"] == 64 and cfg["dqk"] - cfg["dv"] <= cfg["dkv_chunk"] and not cfg["stage_atomics"]
    # off by default: measured 3% slower than issuing the atomics after each chunk (H200)
    cfg["overlap"] = bool(cfg.get("overlap", False)) and can_overlap and cfg["store_dkv"]
    if cfg["dv"] > cfg["dqk"] or cfg["dv"] % cfg["dkv_chunk"] or cfg["dqk"] % 16 or cfg["dv"] % 16:
        raise ValueError(f"unsupported dims dqk={cfg['dqk']} dv={cfg['dv']} (need dv <= dqk, multiples of 16, "
                         f"dv a multiple of dkv_chunk={cfg['dkv_chunk']})")
    # schedule: "ws" (warp-specialised program, the atomic mode with or without head-summed
    # probabilities) where its shapes allow, else "plain" (the program that serves every mode)
    # (the ws program walks the slots in blocks of 64: the wrapper pads k to block_k)
    ws_ok = ws_supported(cfg["dqk"], cfg["dv"]) and cfg["block_k"] == 64
    cfg["schedule"] = str(cfg.get("schedule") or ("ws" if ws_ok else "plain"))
    if cfg["schedule"] not in _SCHEDULES:
        raise ValueError(f"schedule must be one of {_SCHEDULES}, got {cfg['schedule']!r}")
    # l2_keep (the ws program, or the plain one with stage_atomics): the v4 reductions carry an L2
    # evict_last policy, so the fp32 dkv lines stay in L2 while gathered rows stream through;
    # measured no faster on an H100 (Skv 8K-128K), off
    cfg["l2_keep"] = bool(cfg.get("l2_keep", False)) and (cfg["stage_atomics"] or cfg["schedule"] == "ws")
    # measured on an H100 (B1 S4096 Skv8192): prefetch 1.01x (MLA H64) and 1.03x (V4 H128), dq from
    # registers 1.00-1.02x (off: within noise)
    cfg["ws_prefetch"] = bool(cfg.get("ws_prefetch", True))
    # Tried and dropped (fa5e348): with the next block's indices, its kv rows (and their dkv rows) brought into L2 by
    # cp.async.bulk.prefetch.L2. H100, S4096 k2048, ms without / kv rows / kv and dkv rows: MLA H128 Skv 8K 14.45 /
    # 18.6 / 25.2 (L2 is the busy unit there, 80% of its peak, and a prefetch of a line it holds is one more access),
    # Skv 32K 24.0 / 23.3 / 25.8, Skv 128K 29.5 / 29.4 / 31.9; V4 H64 2.16 / 2.64 / 3.34
    # skip_tail: each query row walks its slot blocks only up to its last valid slot (causal rows, the first
    # tokens of packed sequences). On for the ws program, whose CTAs find their row's last valid slot themselves
    # (H100, causal S 4096 k 2048: MLA H64 7.97 -> 6.44 ms, H128 15.32 -> 12.90; full rows within 0.4%), off for
    # the plain one (its pipelined gather serialises on a trip count read from memory: 15.43 vs 11.56 ms)
    skip = cfg.get("skip_tail")
    cfg["skip_tail"] = bool(cfg["schedule"] == "ws" if skip is None else skip)
    cfg["ws_dq_rs"] = bool(cfg.get("ws_dq_rs", False))
    # ws_pair: the two head blocks of a query row sum their dkv chunks in a 2-CTA cluster before reducing
    # (half the reductions; see _ws_body): the atomic mode, an even number of head blocks, dqk == dv. Off:
    # measured slower on an H100 (V4 H128 k1024: 8.42 vs 8.03 ms; Nsight Compute: L2 busy 42% vs 78%, warp
    # cycles per issued instruction 8.3 vs 6.8): with half the reductions the time does not fall, so at this
    # shape the L2 reductions are not what bounds the program; the per-block chain of its two warpgroups is.
    # Again with every later change (adbefb9, one process, two rounds): 7.82 / 7.79 ms against 6.71 / 6.66
    cfg["ws_pair"] = (bool(cfg.get("ws_pair", False)) and cfg["schedule"] == "ws"
                      and ws_pair_supported(cfg["heads"], cfg["dqk"], cfg["dv"]))
    # ws_wg0_chunks: warpgroup 0 forms and reduces the last n dkv chunks itself (see _ws_body); not with ws_pair,
    # whose chunk exchange stays in warpgroup 1. Defaults measured on an H100 (B1 S4096 Skv8192, n = 0 / 1 / 2 / 3):
    # MLA H64 8.37 / 8.30 / 8.65 / 8.19 ms, MLA H128 16.62 / 16.32 / 16.23 / 16.12, V4 H128 k1024 8.09 / 7.93 /
    # 7.80 / 8.21, V4 H64 k512 2.48 / 2.39 / 2.35 / 2.42: 3 for the 576-wide layout, 2 for D512 (4: 9.21 / 17.98 /
    # 9.10 / 2.65 against the defaults' 8.08 / 16.03 / 7.75 / 2.36 in one run: warpgroup 0 becomes the chain)
    n0, n_chunks = cfg.get("ws_wg0_chunks"), cfg["dv"] // 64 + (cfg["dqk"] > cfg["dv"])
    if cfg["ws_pair"] or cfg["schedule"] != "ws":
        n0 = 0
    elif n0 is None:
        # with ws_dkv_perm and ws_tma_q, 2 at 576/512 too (H100, one process, two rounds, against 3: MLA H64 7.32 /
        # 8.31 ms against 7.55 / 7.62, H128 14.51 / 14.74 against 14.93 / 16.32, H64 causal 5.69 / 5.71 against 6.07 /
        # 5.92; the 8.31 and 16.32 were outliers of that round). Again with ws_row_regs (adbefb9, two rounds; ms, 3 / 1
        # against 2): MLA H64 7.43, 7.48 / 7.00, 7.88 against 6.97, 6.97; H128 14.50, 16.83 / 13.85, 13.98 against
        # 13.73, 13.75; V4 H128 7.09, 7.01 / 6.75, 7.62 against 6.64, 6.60; V4 H64 1.989, 2.026 / 2.010, 2.015 against
        # 1.925, 1.958
        n0 = min(2, n_chunks // 2)
    elif not 0 <= int(n0) <= min(3, n_chunks - 1):
        raise ValueError(f"ws_wg0_chunks must be 0..{min(3, n_chunks - 1)} (dkv chunks: {n_chunks}), got {n0}")
    cfg["ws_wg0_chunks"] = int(n0)
    # fast_exp2: the ws program's P = 2^x as one MUFU.EX2 (kernels.fast_exp2); the plain program keeps exp2f.
    # H100, B1 S4096 Skv8192, with the reductions' row addresses (dsa_red_tile), against neither: MLA H64 1.04x,
    # H128 1.03x, V4 H128 1.05x, V4 H64 1.03x
    fast = cfg.get("fast_exp2")
    cfg["fast_exp2"] = True if fast is None else bool(fast)
    # det_store_pred: the ws program's contribution stores predicated inside their asm, no branch (see _ws_body).
    # On for D512 only. H100, B1 S4096 Skv8192, "contrib_i16": V4 H128 k1024 12.10 / 12.11 ms against 12.50 / 12.58
    # without, V4 H64 k512 3.60 / 3.60 against 3.67 / 3.70 (one process, two rounds); at 576/512 slower (MLA H64 /
    # H128 1.79 / 1.85x the atomic time against 1.77 / 1.78x, another run: its spills grow from 68 to 92 bytes)
    pred = cfg.get("det_store_pred")
    cfg["det_store_pred"] = bool(cfg["dqk"] == cfg["dv"] if pred is None else pred) and cfg["schedule"] == "ws"
    # ws_tma_q: the ws program's q and dout by TMA (see _ws_body). On for D512: H100, B1 S4096 Skv8192, one process,
    # two rounds against the threads' copies: V4 H64 k512 2.195 / 2.199 ms against 2.299 / 2.306 (1.05x), V4 H128
    # k1024 7.45 / 7.40 against 7.52 / 7.48 (1.01x); the 576-wide program spills more with it (120 against 100
    # bytes) and measured 0.99x (MLA H64 7.95 / 7.91 against 7.81 / 7.84; H128 and causal rows no better)
    # With ws_dkv_perm (fewer registers in warpgroup 1's reductions) also on at 576/512: MLA H128 14.93 / 16.32 ms
    # (an outlier) against 15.13 / 15.26, with ws_wg0_chunks 2 14.51 / 14.74 (1.04x)
    tma = cfg.get("ws_tma_q")
    cfg["ws_tma_q"] = bool(True if tma is None else tma) and cfg["schedule"] == "ws"
    # ws_fused_pre: the ws program forms lse' and Delta = rowsum(out * dout) itself instead of a preprocess pass
    # over out and dout before it (see _ws_body; not with det_mode "fixed", whose preprocess also takes maxima).
    # H100, B1 S4096 Skv8192, one process, two rounds, against the preprocess (0.19 ms at H64, 0.37 at H128): MLA H64
    # 7.80 / 7.77 ms against 7.85 / 7.85, MLA H128 15.48 / 15.54 against 15.64 / 16.63, V4 H128 7.39 / 7.32 against
    # 7.39 / 7.42, V4 H64 2.147 / 2.168 against 2.199 / 2.211, MLA H64 causal 6.08 / 6.33 against 6.65 / 6.67;
    # deterministic V4 H128 11.28 against 11.75. At D512 the program itself takes 0.1-0.2 ms longer (its first dS
    # waits for Delta, whose out rows share the CTA's start with q and dout)
    fused = cfg.get("ws_fused_pre")
    cfg["ws_fused_pre"] = bool(True if fused is None else fused) and cfg["schedule"] == "ws"
    # ws_dkv_perm: the ws program adds into dkv with its columns permuted within groups of 16 (one register exchange
    # per reduction instead of two, as cuDNN's sm90 backward does; the wrapper restores their order after, a copy of
    # dkv), and stores its contribution rows so (no exchange; the reduce restores the order). On: H100, B1 S4096
    # Skv8192, one process, two rounds, against the real order: MLA H64 7.69 / 7.69 ms against 7.74 / 7.84, MLA
    # H128 15.16 / 15.22 against 15.47 / 15.37, V4 H128 7.21 / 7.24 against 7.41 / 7.40, V4 H64 2.165 / 2.171 against
    # 2.150 / 2.165 (its program 2.05 against 2.08-2.12 ms; the order's restore costs 0.02 ms); deterministic
    # ("contrib_i16") MLA H64 12.71 / 12.74 against 13.80 / 14.10, H128 25.57 / 25.53 against 27.42 / 27.56, V4 H64
    # 3.33 / 3.36 against 3.39 / 3.43 (V4 H128's det_pair then kept the real order; det_pair_perm permutes it too)
    perm = cfg.get("ws_dkv_perm")
    cfg["ws_dkv_perm"] = bool(True if perm is None else perm) and cfg["schedule"] == "ws"
    # ws_stage_dq: dq stored through shared memory in 16-byte pieces (see _ws_body; Nsight Compute had ours writing
    # twice cuDNN's L2 sectors). On: H100, B1 S4096 Skv8192, one process, two rounds against the fragments' stores:
    # MLA H64 7.07 / 7.07 ms against 7.29 / 7.26, MLA H128 13.98 (a second round's 16.26 an outlier) against 14.48 /
    # 14.42, V4 H128 6.93 / 6.97 against 7.19 / 7.21, V4 H64 2.044 / 2.049 against 2.154 / 2.163 (1.03-1.055x)
    stage = cfg.get("ws_stage_dq")
    cfg["ws_stage_dq"] = bool(True if stage is None else stage) and cfg["schedule"] == "ws"
    # ws_row_regs: how warpgroup 0 forms P and dS at invalid slots (see _ws_body; Nsight Compute had its softmax
    # waiting on shared and constant loads that ptxas re-issued for every score under the slot test). 2 at D512,
    # 1 at 576/512 (where 2 spills in warpgroup 1's reductions). H100, B1 S4096 Skv8192, one process, three
    # rounds (ms; 0 / 1 / 2): V4 H128 6.94, 7.58, 6.94 / 6.83, 7.40, 6.83 / 6.68, 6.69, 6.70; V4 H64 2.040, 2.056,
    # 2.078 / 2.018, 2.036, 2.038 / 2.015, 2.013, 2.023; MLA H128 13.90, 13.98, 14.55 / 13.64, 13.92, 13.80 /
    # 14.35, 16.31, 15.13; MLA H64 6.97, 7.34, 7.08 / 6.97, 7.82, 7.25 / 7.42, 7.44, 7.42. Tried and dropped: the
    # softmax as 2 with dS under the slot test (the other half of 1's choice; 0389325, two rounds against the
    # defaults: MLA H64 7.07 / 7.87 against 6.92 / 6.94, H128 13.81 / 14.00 against 13.71 / 13.70, V4 H128 6.68 /
    # 7.21 against 6.59 / 6.57, V4 H64 1.950 / 1.963 against 1.917 / 1.962); dS zeroed where P is 0, no flag load
    # in dS (adbefb9: 1-2% slower at all four shapes)
    row_regs = cfg.get("ws_row_regs")
    if row_regs is None:
        row_regs = 2 if cfg["dqk"] == cfg["dv"] else 1
    if int(row_regs) not in (0, 1, 2):
        raise ValueError(f"ws_row_regs must be 0, 1 or 2, got {row_regs!r}")
    cfg["ws_row_regs"] = int(row_regs) if cfg["schedule"] == "ws" else 0
    # ws_tma_dq (opt-in, with ws_stage_dq): the staged dq tiles leave by TMA stores. Off: even, within noise, over
    # four rounds in two processes (0389325 / adbefb9; ms, on against off): MLA H64 6.94, 6.95, 7.00, 7.00 against
    # 6.92, 6.94, 6.97, 6.97; MLA H128 13.82, 15.33, 13.81, 14.69 against 13.71, 13.70, 13.73, 13.75; V4 H128 6.53,
    # 6.46, 6.62, 6.79 against 6.59, 6.57, 6.64, 6.60; V4 H64 1.918, 1.928, 1.931, 2.201 against 1.917, 1.962,
    # 1.925, 1.958
    cfg["ws_tma_dq"] = bool(cfg.get("ws_tma_dq") or False) and cfg["ws_stage_dq"]
    # det_pair: the ws program's contribution modes with the two head blocks of a query row summed in a 2-CTA
    # cluster before storing (the exchange of ws_pair): one contribution row per slot of the pair, half the bytes
    # to store and to reduce. Where ws_pair can run (an even number of head blocks, dqk == dv); its deterministic
    # program leaves every chunk to warpgroup 1 (ws_wg0_chunks is not used there), as ws_pair does
    dp = cfg.get("det_pair")
    cfg["det_pair"] = (bool(True if dp is None else dp) and cfg["schedule"] == "ws"
                       and ws_pair_supported(cfg["heads"], cfg["dqk"], cfg["dv"]))
    # det_pair_perm (default on, with det_pair and ws_dkv_perm): the pair's contribution rows in the unpaired rows'
    # permuted layout, each CTA storing block p = its rank of every 64-column chunk: no register exchanges before
    # the stores, one 16-byte store of a lane's 8 values and int16 blocks of 8 values (one exponent byte per 8
    # values instead of per 4). H100, V4 H128 sink B1 S4096 Skv8192 K1024, deterministic (contrib_i16), one
    # process: 9.66 ms against 11.34 ms off (1.17x); the GPU tests keep both within the same float64 bounds
    dpp = cfg.get("det_pair_perm")
    cfg["det_pair_perm"] = bool(True if dpp is None else dpp) and cfg["det_pair"] and cfg["ws_dkv_perm"]
    # ws_auto_sync: TileLang's automatic thread-storage syncs in the ws program. False (the default) drops warpgroup
    # 0's ten barriers per block (its own named barriers already order them; the head-summed P and the pair keep
    # them): the same bits (GPU test). Measured 0.3-2.5% faster when first built, inside that day's noise; with
    # ws_row_regs (a shorter warpgroup 0) every paired round favoured it: H100, B1 S4096 Skv8192, three rounds (ms,
    # on / off): MLA H64 7.00, 7.00, 7.55 / 6.96, 6.97, 7.35; MLA H128 13.76, 15.69, 14.00 / 13.73, 13.79, 13.76;
    # V4 H128 6.71, 6.67, 7.41 / 6.56, 6.60, 7.00; V4 H64 1.996, 2.015, 2.014 / 1.938, 1.970, 1.951
    auto_sync = cfg.get("ws_auto_sync")
    cfg["ws_auto_sync"] = False if auto_sync is None else bool(auto_sync)
    if cfg["schedule"] == "ws" and not ws_ok:
        raise ValueError(f"schedule 'ws' needs dv a multiple of 128, dqk - dv in (0, 64) and block_k 64, got "
                         f"dqk={cfg['dqk']} dv={cfg['dv']} block_k={cfg['block_k']}")
    # deterministic mode (times against the atomic mode, H100, MLA H64 / H128, V4 H128 / H64; first measured
    # at 028b05d, the stores since made faster: i16 now 1.66 / 1.66, 1.46 / 1.54x and bf16 1.55 / 1.51,
    # 1.29 / 1.40x, 97a044d):
    # "contrib" (the plain program writes per-slot fp32 contributions, sorted and summed: 2.35 / 2.35,
    # 2.06 / 1.88x), "contrib_ws" (the same contributions stored by the ws program: 2.01 / 2.05, 1.83 /
    # 1.72x), "contrib_i16" (int16 with a power of two per 8 values: half the bytes; dkv within 5e-5 of
    # the fp32 sums: 1.86 / 1.96, 1.68 / 1.55x), "contrib_bf16" (bf16: 1.51 / 1.53, 1.42 / 1.36x, within
    # 1.7e-3: a bf16 rounding of each contribution) or "fixed" (the ws program adding fixed-point integers
    # with 64-bit reductions, order-free sums: 4.3-4.8x, L2 takes integer adds ~7x slower per value than
    # fp32 red.v4; its memory is [Skv, dqk] int64, whatever the query count). The default is
    # "contrib_i16" on the ws program's shapes (the fastest mode whose sums stay within 5e-5 of fp32)
    # and "contrib" elsewhere.
    env_mode = deterministic_mode()  # DSA_PLUGINS_DETERMINISTIC=<mode>: the default where config names none
    if not cfg.get("det_mode") and env_mode is not None:
        if env_mode not in _DET_MODES:
            raise ValueError(f"DSA_PLUGINS_DETERMINISTIC must be 0, 1 or a deterministic mode of {_DET_MODES}, "
                             f"got {env_mode!r}")
        if env_mode != "contrib" and cfg["schedule"] != "ws":
            warn_once(f"det_mode:{env_mode}:{cfg['dqk']}:{cfg['dv']}",
                      f"DSA_PLUGINS_DETERMINISTIC={env_mode} needs the ws program's shapes; the backward of dqk="
                      f"{cfg['dqk']} dv={cfg['dv']} (schedule {cfg['schedule']!r}) uses det_mode 'contrib'")
            env_mode = "contrib"
        cfg["det_mode"] = env_mode
    cfg["det_mode"] = str(cfg.get("det_mode") or ("contrib_i16" if cfg["schedule"] == "ws" else "contrib"))
    if cfg["det_mode"] not in _DET_MODES or (cfg["det_mode"] != "contrib" and cfg["schedule"] != "ws"):
        raise ValueError(f"det_mode must be one of {_DET_MODES} (all but 'contrib' need the ws schedule), got "
                         f"{cfg['det_mode']!r} with schedule {cfg['schedule']!r}")
    return cfg


# ----------------------------------------------------------------------------------------------
# Kernel bodies (TileLang imported lazily)
# ----------------------------------------------------------------------------------------------


_PRE_BLOCK_H, _PRE_THREADS = 16, 128  # the preprocess's heads per CTA and threads


def _lse2(T, lse, sink=None):
    """lse' (base 2, the sink's logit ``sink`` folded in where given) from a row's natural-log ``lse``; +inf
    (an empty row) stays +inf. The preprocess and the ws program's ``fused_pre`` both take it from here."""
    if sink is None:
        return lse * _LOG2E
    m = T.max(lse, sink)
    return T.if_then_else(lse == T.infinity(T.float32), lse, (m + T.log(T.exp(lse - m) + T.exp(sink - m))) * _LOG2E)


def _preprocess_args(cfg: dict, maxima: bool) -> tuple:
    """Compile args of the preprocess (``maxima``: the deterministic "fixed" mode's variant)."""
    return (cfg["heads"], cfg["dv"], cfg["has_sink"], cfg["dtype"]) + ((cfg["dqk"],) if maxima else ())


def _preprocess_body(heads, dv, has_sink, dtype, maxima_dqk=0, block_h=_PRE_BLOCK_H, threads=_PRE_THREADS):
    """Delta = rowsum(O * dO) and the base-2 lse (with the sink folded in) per (query row, head).
    ``maxima_dqk`` > 0 (the deterministic "fixed" mode, Q of that width): also Maxima [Tq, NHB, threads, 3]
    = max |q|, |out|, |dout| over the finite entries each thread saw, from which the wrapper takes its
    fixed-point scale without three more passes over q, out and dout."""
    assert block_h * maxima_dqk % threads == 0 and block_h * dv % threads == 0
    import tilelang.language as T

    Tq = T.dynamic("Tq")
    nhb = (heads + block_h - 1) // block_h
    dt = T.bfloat16 if dtype == "bfloat16" else T.float16
    f32 = T.float32
    q_rows = Tq if maxima_dqk else 1  # without maxima, Q and Maxima are [1, ...] placeholders
    dqk = max(maxima_dqk, 1)

    def finite_abs(x):  # |x|, or 0 where x is inf or NaN (NaN < inf is false)
        return T.if_then_else(T.abs(x) < T.infinity(f32), T.abs(x), 0.0)

    @T.prim_func
    def dsa_bwd_preprocess(
        O: T.Tensor([Tq, heads, dv], dt),
        dO: T.Tensor([Tq, heads, dv], dt),
        Lse: T.Tensor([Tq, heads], f32),
        Sink: T.Tensor([heads], f32),
        Delta: T.Tensor([Tq, heads], f32),
        Lse2: T.Tensor([Tq, heads], f32),
        Q: T.Tensor([q_rows, heads, dqk], dt),
        Maxima: T.Tensor([q_rows, nhb, threads, 3], f32),
    ):
        with T.Kernel(Tq, nhb, threads=threads) as (t, hb):
            prod = T.alloc_fragment([block_h, dv], f32)
            dsum = T.alloc_fragment([block_h], f32)
            for i, d in T.Parallel(block_h, dv):
                h = hb * block_h + i
                prod[i, d] = T.if_then_else(
                    h < heads,
                    T.cast(O[t, T.min(h, heads - 1), d], f32) * T.cast(dO[t, T.min(h, heads - 1), d], f32),
                    0.0,
                )
            T.reduce_sum(prod, dsum, dim=1)
            if maxima_dqk:
                # each thread keeps its own running maxima (no cross-thread reductions: the wrapper takes
                # the max over all of them); the O and dO lines are still in L1 from the product above
                tx = T.get_thread_binding()
                mx = T.alloc_local([3], f32)
                for c in T.serial(3):
                    mx[c] = 0.0
                for k in T.serial(block_h * dv // threads):
                    h = hb * block_h + (k * threads + tx) // dv
                    d = (k * threads + tx) % dv
                    if h < heads:
                        mx[1] = T.max(mx[1], finite_abs(T.cast(O[t, h, d], f32)))
                        mx[2] = T.max(mx[2], finite_abs(T.cast(dO[t, h, d], f32)))
                for k in T.serial(block_h * dqk // threads):
                    h = hb * block_h + (k * threads + tx) // dqk
                    if h < heads:
                        mx[0] = T.max(mx[0], finite_abs(T.cast(Q[t, h, (k * threads + tx) % dqk], f32)))
                for c in T.serial(3):
                    Maxima[t, hb, tx, c] = mx[c]
            for i in T.Parallel(block_h):
                h = hb * block_h + i
                if h < heads:
                    lse = Lse[t, h]
                    # an empty row (lse +inf) gives nothing back, whatever dout carries (NaN included)
                    Delta[t, h] = T.if_then_else(lse == T.infinity(f32), 0.0, dsum[i])
                    Lse2[t, h] = _lse2(T, lse, Sink[h] if has_sink else None)

    return dsa_bwd_preprocess


_SMEM_LIMIT = 232448  # bytes of shared memory one Hopper block may use (227 KiB)


def _probs_batch(dqk: int, dv: int, block_k: int, threads: int, dkv_chunk: int, stage_atomics: bool) -> int:
    """Slots per batched cross-warp AllReduce in the head sum of P [64, block_k] (one barrier pair
    per batch instead of one per slot). A thread holds block_k * 128 / threads / 4 slots (FullCol
    warps); the batch needs threads * batch fp32 of workspace in the shared memory the main
    buffers leave (2 KiB for 576/512: batch 2; 512/512: batch 8)."""
    used = 2 * 64 * (3 * dv + 2 * (dqk - dv)) + 2 * 2 * 64 * block_k + 2 * 4 * 64
    if stage_atomics:
        used += 4 * block_k * (dkv_chunk + (dqk - dv))
    per_thread = max(1, block_k * 128 // threads // 4)
    batch = per_thread
    while batch > 1 and (per_thread % batch or used + threads * batch * 4 > _SMEM_LIMIT):
        batch //= 2
    return batch


# red.global.add.v4.f32 with an L2 evict_last policy (l2_keep): 4 fp32 from shared memory
_L2_KEEP_PRELUDE = r"""
__device__ __forceinline__ void dsa_red_v4_keep(float* g, const float* s) {
  float4 v = *reinterpret_cast<const float4*>(s);
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;"
               :: "l"(g), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "l"(policy) : "memory");
}
"""


def _main_body(heads, dqk, dv, dtype, block_k, num_stages, threads, dkv_chunk, deterministic, store_dkv=True,
               stage_atomics=True, overlap=False, emit_probs=False, skip_tail=False, l2_keep=False):
    import tilelang.cuda.language as TC
    import tilelang.language as T

    dt = T.bfloat16 if dtype == "bfloat16" else T.float16
    f32 = T.float32
    i32 = T.int32
    BH = _BLOCK_H
    BK = block_k
    DT = dqk - dv  # K-only tail (rope part of absorbed MLA); 0 for V4
    DC = dkv_chunk
    NC = dv // DC
    NHB = (heads + BH - 1) // BH
    pad_h = heads % BH != 0
    stage_q_dout, stage_lse_delta = _head_rows_macros(T, heads, dv, DT, BH)

    Tq = T.dynamic("Tq")
    N = T.dynamic("N")
    Kp = T.dynamic("Kp")
    ninf = -T.infinity(f32)

    if deterministic:
        dkv_shape = [Tq, NHB, Kp, dqk]
    else:
        dkv_shape = [N, dqk]
    probs_batch = _probs_batch(dqk, dv, BK, threads, DC, stage_atomics and not deterministic)
    l2_keep_on = l2_keep and stage_atomics and not deterministic
    if overlap:
        assert not deterministic and store_dkv and not stage_atomics and BK == 64 and DT <= DC
    # (first column, width, has a V part) of each dkv column chunk; static, unrolled
    chunks = tuple([(c * DC, DC, True) for c in range(NC)] + ([(dv, DT, False)] if DT > 0 else []))
    NCH = len(chunks)
    chunk_ids = tuple(range(NCH))

    @T.macro
    def _issue_chunk(ci, q_s, qt_s, do_s, p_s, ds_s, acc_kv_pair, acc_kvt):
        c0, w, has_v = chunks[ci]
        if has_v:
            buf = acc_kv_pair[ci % 2]
            T.wgmma_gemm(ds_s, q_s[:, c0 : c0 + w], buf, transpose_A=True, policy=T.GemmWarpPolicy.FullCol,
                         clear_accum=True)
            T.wgmma_gemm(p_s, do_s[:, c0 : c0 + w], buf, transpose_A=True, policy=T.GemmWarpPolicy.FullCol)
        else:
            T.wgmma_gemm(ds_s, qt_s, acc_kvt, transpose_A=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)

    @T.macro
    def _red4(dst, src):
        # four fp32 from shared memory added to global memory (one v4 reduction)
        if l2_keep_on:
            T.call_extern("handle", "dsa_red_v4_keep", T.address_of(dst), T.address_of(src))
        else:
            T.atomic_addx4(dst, src)

    @T.macro
    def _atomic_rows(Idx, dKV, t, kb, c0, acc, w):
        for r, d in T.Parallel(BK, w):
            if Idx[t, kb * BK + r] >= 0:
                T.atomic_add(dKV[Idx[t, kb * BK + r], c0 + d], acc[r, d])

    @T.macro
    def _body(Q, KV, dO, Idx, Lse2, Delta, dQ, dKV, scale, scale_log2, Probs, RowBlocks):
        # head blocks fastest: the CTAs of one query row run together, so at long Skv the dkv rows their
        # reductions share (every head block adds into the same selected rows) are still in L2. One grid
        # dimension (x: up to 2**31 - 1 CTAs; y would cap the query rows at 65535)
        with TC.Kernel(NHB * Tq, threads=threads, prelude=_L2_KEEP_PRELUDE if l2_keep_on else None) as bx:
            hb = bx % NHB
            t = bx // NHB
            q_s = T.alloc_shared([BH, dv], dt)
            do_s = T.alloc_shared([BH, dv], dt)
            v_s = T.alloc_shared([BK, dv], dt)
            p_s = T.alloc_shared([BH, BK], dt)
            ds_s = T.alloc_shared([BH, BK], dt)
            lse_s = T.alloc_shared([BH], f32)
            delta_s = T.alloc_shared([BH], f32)
            acc_s = T.alloc_fragment([BH, BK], f32)
            acc_dp = T.alloc_fragment([BH, BK], f32)
            acc_dq = T.alloc_fragment([BH, dv], f32)
            acc_kv = T.alloc_fragment([BK, DC], f32)
            psum_f = T.alloc_fragment([BK], f32) if emit_probs else None
            acc_kv_pair = [acc_kv, T.alloc_fragment([BK, DC], f32)] if overlap else [acc_kv]
            qt_s = None
            acc_kvt = None
            if DT > 0:
                qt_s = T.alloc_shared([BH, DT], dt)
                kt_s = T.alloc_shared([BK, DT], dt)
                acc_dqt = T.alloc_fragment([BH, DT], f32)
                acc_kvt = T.alloc_fragment([BK, DT], f32)
            if not deterministic and stage_atomics:
                stage_s = T.alloc_shared([BK, DC], f32)
                if DT > 0:
                    staget_s = T.alloc_shared([BK, DT], f32)

            h0 = hb * BH
            if pad_h:
                stage_q_dout(Q, dO, t, h0, q_s, do_s, qt_s)
                stage_lse_delta(Lse2, Delta, t, h0, lse_s, delta_s)
            else:
                T.copy(Q[t, h0 : h0 + BH, 0:dv], q_s)
                T.copy(dO[t, h0 : h0 + BH, 0:dv], do_s)
                if DT > 0:
                    T.copy(Q[t, h0 : h0 + BH, dv:dqk], qt_s)
                T.copy(Lse2[t, h0 : h0 + BH], lse_s)
                T.copy(Delta[t, h0 : h0 + BH], delta_s)

            T.clear(acc_dq)
            if DT > 0:
                T.clear(acc_dqt)

            # skip_tail: blocks past the row's last valid slot hold only -1 and add nothing
            n_blocks = RowBlocks[t] if skip_tail else T.ceildiv(Kp, BK)
            for kb in T.Pipelined(n_blocks, num_stages=num_stages):
                # gather the selected rows; invalid slots (-1) are zero-filled, never read
                for r, d in T.Parallel(BK, dv):
                    v_s[r, d] = KV[Idx[t, kb * BK + r], d]
                if DT > 0:
                    for r, d in T.Parallel(BK, DT):
                        kt_s[r, d] = KV[Idx[t, kb * BK + r], dv + d]
                for i, r in T.Parallel(BH, BK):
                    acc_s[i, r] = T.if_then_else(Idx[t, kb * BK + r] >= 0, 0, ninf)
                T.gemm(q_s, v_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                if DT > 0:
                    T.gemm(qt_s, kt_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
                T.gemm(do_s, v_s, acc_dp, transpose_B=True, policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                # P = exp(s * scale - lse'): masked slots and padded heads give exactly 0. The slot test
                # is explicit: -inf + a NaN or inf score of q would not stay -inf
                for i, r in T.Parallel(BH, BK):
                    acc_s[i, r] = T.if_then_else(
                        Idx[t, kb * BK + r] >= 0, T.exp2(acc_s[i, r] * scale_log2 - lse_s[i]), 0.0)
                if emit_probs:
                    # sum of P over this CTA's heads, per slot: the indexer loss's attention target
                    # (fp32, before P is rounded for the MMAs)
                    T.reduce_sum(acc_s, psum_f, dim=0, clear=True, batch=probs_batch)
                    for r in T.Parallel(BK):
                        Probs[hb, t, kb * BK + r] = psum_f[r]
                for i, r in T.Parallel(BH, BK):
                    acc_dp[i, r] = T.if_then_else(
                        Idx[t, kb * BK + r] >= 0, acc_s[i, r] * (acc_dp[i, r] - delta_s[i]) * scale, 0.0)
                T.copy(acc_s, p_s)
                T.copy(acc_dp, ds_s)
                # dq += scale * dS @ K   (scale folded into dS)
                T.gemm(ds_s, v_s, acc_dq, policy=T.GemmWarpPolicy.FullCol)
                if DT > 0:
                    T.gemm(ds_s, kt_s, acc_dqt, policy=T.GemmWarpPolicy.FullCol)
                # dkv[idx] += dS^T q + P^T dout, one column chunk at a time
                if overlap:
                    # software pipeline over the chunks: the MMAs of chunk c+1 run (async wgmma)
                    # while the atomics of chunk c are issued from registers
                    _issue_chunk(0, q_s, qt_s, do_s, p_s, ds_s, acc_kv_pair, acc_kvt)
                    for ci in chunk_ids:
                        if ci + 1 < NCH:
                            _issue_chunk(ci + 1, q_s, qt_s, do_s, p_s, ds_s, acc_kv_pair, acc_kvt)
                            T.wait_wgmma(2 if chunks[ci + 1][2] else 1)
                        else:
                            T.wait_wgmma(0)
                        c0, w, has_v = chunks[ci]
                        if has_v:
                            _atomic_rows(Idx, dKV, t, kb, c0, acc_kv_pair[ci % 2], w)
                        else:
                            _atomic_rows(Idx, dKV, t, kb, c0, acc_kvt, w)
                if not overlap:
                    for c in T.unroll(NC):
                        T.gemm(ds_s, q_s[:, c * DC : (c + 1) * DC], acc_kv, transpose_A=True,
                               policy=T.GemmWarpPolicy.FullCol, clear_accum=True)
                        T.gemm(p_s, do_s[:, c * DC : (c + 1) * DC], acc_kv, transpose_A=True,
                               policy=T.GemmWarpPolicy.FullCol)
                        if not store_dkv:
                            pass  # benchmark ablation only: dkv is not written
                        elif deterministic:
                            T.copy(acc_kv, dKV[t, hb, kb * BK : (kb + 1) * BK, c * DC : (c + 1) * DC])
                        elif stage_atomics:
                            T.copy(acc_kv, stage_s)
                            for r, d4 in T.Parallel(BK, DC // 4):
                                if Idx[t, kb * BK + r] >= 0:
                                    _red4(dKV[Idx[t, kb * BK + r], c * DC + d4 * 4], stage_s[r, d4 * 4])
                        else:
                            for r, d in T.Parallel(BK, DC):
                                if Idx[t, kb * BK + r] >= 0:
                                    T.atomic_add(dKV[Idx[t, kb * BK + r], c * DC + d], acc_kv[r, d])
                if DT > 0 and not overlap:
                    T.gemm(ds_s, qt_s, acc_kvt, transpose_A=True, policy=T.GemmWarpPolicy.FullCol,
                           clear_accum=True)
                    if not store_dkv or overlap:
                        pass
                    elif deterministic:
                        T.copy(acc_kvt, dKV[t, hb, kb * BK : (kb + 1) * BK, dv:dqk])
                    elif stage_atomics:
                        T.copy(acc_kvt, staget_s)
                        for r, d4 in T.Parallel(BK, DT // 4):
                            if Idx[t, kb * BK + r] >= 0:
                                _red4(dKV[Idx[t, kb * BK + r], dv + d4 * 4], staget_s[r, d4 * 4])
                    else:
                        for r, d in T.Parallel(BK, DT):
                            if Idx[t, kb * BK + r] >= 0:
                                T.atomic_add(dKV[Idx[t, kb * BK + r], dv + d], acc_kvt[r, d])

            if pad_h:
                for i, d in T.Parallel(BH, dv):
                    if h0 + i < heads:
                        dQ[t, h0 + i, d] = acc_dq[i, d]
                if DT > 0:
                    for i, d in T.Parallel(BH, DT):
                        if h0 + i < heads:
                            dQ[t, h0 + i, dv + d] = acc_dqt[i, d]
            else:
                T.copy(acc_dq, dQ[t, h0 : h0 + BH, 0:dv])
                if DT > 0:
                    T.copy(acc_dqt, dQ[t, h0 : h0 + BH, dv:dqk])

    # Probs [NHB, Tq, Kp] with emit_probs, RowBlocks [Tq] with skip_tail; otherwise one-element
    # placeholders the body never touches
    probs_shape = [NHB, Tq, Kp] if emit_probs else [1]
    row_blocks_shape = [Tq] if skip_tail else [1]

    @T.prim_func
    def dsa_bwd_main(
        Q: T.Tensor([Tq, heads, dqk], dt),
        KV: T.Tensor([N, dqk], dt),
        dO: T.Tensor([Tq, heads, dv], dt),
        Idx: T.Tensor([Tq, Kp], i32),
        Lse2: T.Tensor([Tq, heads], f32),
        Delta: T.Tensor([Tq, heads], f32),
        dQ: T.Tensor([Tq, heads, dqk], dt),
        dKV: T.Tensor(dkv_shape, f32),
        scale: f32,
        scale_log2: f32,
        Probs: T.Tensor(probs_shape, f32),
        RowBlocks: T.Tensor(row_blocks_shape, i32),
    ):
        _body(Q, KV, dO, Idx, Lse2, Delta, dQ, dKV, scale, scale_log2, Probs, RowBlocks)

    return dsa_bwd_main


# ----------------------------------------------------------------------------------------------
# Warp-specialised main program ("ws" schedule)
# ----------------------------------------------------------------------------------------------

# dkv += one warpgroup's m64n64 fp32 wgmma accumulator tile (64 slots x 64 columns), sent as full
# 128-byte lines of red.global.add.v4.f32. In the accumulator a thread holds, for rows
# r0 = 16 * warp + lane / 4 and r0 + 8, the column pairs 8 j + 2 (lane % 4) + {0, 1}, j = 0..7
# (register 4 j + 2 * half + parity). Two shuffles regroup them without leaving registers: lanes
# q and q ^ 1 trade pairs so each holds 4 consecutive columns, then lanes g and g ^ 1 (rows r and
# r + 1) trade float4s so that 8 lanes cover one row's 128-byte line: a warp's reduction touches
# 4 whole lines (the v2 reductions straight from the layout touch 8 rows x 32 bytes).
_WS_PRELUDE = CLUSTER_PRELUDE + ROW_SCAN_PRELUDE + _ex2.PRELUDE + r"""
// kMode 0: red.v4.f32; 1: the same with an L2 evict_last policy; 2: fixed point (deterministic mode):
// each value times the power of two `fix` is rounded to a 64-bit integer and added to `sums` with
// red.add.u64 (integer addition is associative: the sums do not depend on the order the CTAs reach
// L2). A value that is not finite goes to the fp32 dkv as it is (NaN, +-inf: any order gives the same
// result); one beyond the per-value bound the scale was chosen for (`limit`: 2^60 over the most values a
// kv row can receive, so no sum can leave int64) goes there as NaN (never a wrapped integer).
__device__ __forceinline__ void dsa_fixed_add(unsigned long long* sums, float* dkv, float v, float fix, float limit) {
  const float y = v * fix;
  if (fabsf(y) <= limit) {
    asm volatile("red.global.add.u64 [%0], %1;" :: "l"(sums), "l"(__float2ll_rn(y)));
  } else {
    atomicAdd(dkv, isfinite(v) ? __int_as_float(0x7fffffff) : v);
  }
}

__device__ __forceinline__ float dsa_pick4(float4 v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Fixed-point adds of a quad's 16 consecutive columns of one row (lane q of the quad holds the float4
// at column offset 8 (q & 1) + 4 (q >> 1)). A 4x4 transpose over the quad first gives lane q element q
// of every float4, so each red.add.u64 of the quad fills one whole 32-byte sector (4 lanes x 8 bytes);
// straight from the float4s, the 4 lanes would put one value into each of 4 sectors (H100, MLA H64:
// the kernel 52.5 -> 42.7 ms; what is left is L2's per-value cost of 64-bit integer adds). All lanes
// take part in the shuffles; rows < 0 (invalid slots) add nothing.
__device__ __forceinline__ void dsa_fixed_quad(int64_t* sums, float* dkv, int row, int ld, int col, float4 v,
                                               float fix, float limit, int q) {
  float z[4];  // z[m]: element q of lane (q ^ m)'s float4
  z[0] = dsa_pick4(v, q);
  #pragma unroll
  for (int m = 1; m < 4; ++m) z[m] = __shfl_xor_sync(0xffffffffu, dsa_pick4(v, q ^ m), m);
  if (row < 0) return;
  #pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int m = q ^ e;
    const float val = m == 0 ? z[0] : m == 1 ? z[1] : m == 2 ? z[2] : z[3];
    const long long off = (long long)row * ld + col + 8 * (e & 1) + 4 * (e >> 1) + q;
    dsa_fixed_add(reinterpret_cast<unsigned long long*>(sums) + off, dkv + off, val, fix, limit);
  }
}

// red.v4 at p where ok (a predicate inside the asm: no branch around it)
template <int kMode>
__device__ __forceinline__ void dsa_red4(float* p, float4 v, unsigned long long policy, bool ok) {
  if (kMode == 1) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %6, 0;\n\t"
                 "@q red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;\n\t}"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "l"(policy), "r"(static_cast<int>(ok)));
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
                 "@q red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<int>(ok)));
  }
}

// kMode 3 (deterministic "contrib_ws"): no reduction at all; dkv is the contribution buffer and slot s of
// the tile stores its values (streaming stores: the reduce reads them much later) in row row0 + s;
// invalid slots store nothing (the reduce never reads them). kMode 4 ("contrib_bf16"): the same rows in a
// bf16 buffer (each value rounded to nearest even). kMode 5 ("contrib_i16"): the same rows as int16 in
// block floating point: the 8 values a lane holds of one row (columns x..x+3 and x+32..x+35 of the tile,
// x = 16 gb + 8 odd + 4 (q >> 1)) share a power of two chosen from their largest magnitude m (values times
// 2^(14 - e), m < 2^e, rounded: |int| <= 2^14, a step of 2^-14..2^-13 of m), and the byte
// exps[row, col0 / 8 + x / 4] gets the exponent field of its inverse 2^(e - 14) (255 where a value is not
// finite: the reduce reads it as NaN, so the row's sum is NaN whatever was stored). Each lane's block is its own,
// so no shuffles delay the stores.
__device__ __forceinline__ unsigned int dsa_bf16x2(float lo, float hi) {
  unsigned int r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// lo * scale and hi * scale (|.| <= 2^14) rounded to integers as two int16 halves: adding 1.5 * 2^23 in the
// same fma rounds to the nearest integer (ties to even) and leaves it, two's complement, in the low mantissa
// bits (no float-to-int conversion, which the SM issues at a quarter of the fma rate).
__device__ __forceinline__ unsigned int dsa_i16x2(float lo, float hi, float scale) {
  const float rl = fmaf(lo, scale, 12582912.0f), rh = fmaf(hi, scale, 12582912.0f);
  return __byte_perm(__float_as_uint(rl), __float_as_uint(rh), 0x5410);
}

// the largest |value| of a float4 as its bit pattern: an integer max orders finite magnitudes, then inf, then NaN
__device__ __forceinline__ unsigned int dsa_absmax4_bits(float4 v) {
  return max(max(__float_as_uint(v.x) & 0x7fffffffu, __float_as_uint(v.y) & 0x7fffffffu),
             max(__float_as_uint(v.z) & 0x7fffffffu, __float_as_uint(v.w) & 0x7fffffffu));
}

// a contribution row's 4 values at dst where ok. kPred: the predicate inside the store's asm and no guard on the
// scale (no branch: a block that is not finite has scale 0 and stores whatever 0 * v rounds to, which the
// reduce ignores, as its exponent byte 255 reads back as NaN); else a branch around a plain streaming store and
// zeros for such a block.
template <int kMode, bool kPred>
__device__ __forceinline__ void dsa_store_row4(void* dst, float4 v, float scale, bool ok) {
  if (kPred) {
    if (kMode == 3) {
      asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
                   "@q st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};\n\t}"
                   :: "l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(static_cast<int>(ok)) : "memory");
    } else {
      const unsigned a = kMode == 4 ? dsa_bf16x2(v.x, v.y) : dsa_i16x2(v.x, v.y, scale);
      const unsigned b = kMode == 4 ? dsa_bf16x2(v.z, v.w) : dsa_i16x2(v.z, v.w, scale);
      asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %3, 0;\n\t"
                   "@q st.global.cs.v2.b32 [%0], {%1, %2};\n\t}"
                   :: "l"(dst), "r"(a), "r"(b), "r"(static_cast<int>(ok)) : "memory");
    }
  } else if (ok) {
    if (kMode == 3) {
      __stcs(reinterpret_cast<float4*>(dst), v);
    } else {
      const uint2 packed = kMode == 4 ? make_uint2(dsa_bf16x2(v.x, v.y), dsa_bf16x2(v.z, v.w))
                           : scale == 0.0f ? make_uint2(0u, 0u)
                                           : make_uint2(dsa_i16x2(v.x, v.y, scale), dsa_i16x2(v.z, v.w, scale));
      __stcs(reinterpret_cast<uint2*>(dst), packed);
    }
  }
}

// a contribution row's 8 values (two float4 of one block, v0 first) at dst where ok, as dsa_store_row4 stores 4:
// one 16-byte store of 16-bit values (fp32: two)
template <int kMode, bool kPred>
__device__ __forceinline__ void dsa_store_row8(void* dst, float4 v0, float4 v1, float scale, bool ok) {
  if (kMode == 3) {
    dsa_store_row4<kMode, kPred>(dst, v0, scale, ok);
    dsa_store_row4<kMode, kPred>(static_cast<char*>(dst) + 16, v1, scale, ok);
    return;
  }
  uint4 w = kMode == 4 ? make_uint4(dsa_bf16x2(v0.x, v0.y), dsa_bf16x2(v0.z, v0.w), dsa_bf16x2(v1.x, v1.y),
                                    dsa_bf16x2(v1.z, v1.w))
                       : make_uint4(dsa_i16x2(v0.x, v0.y, scale), dsa_i16x2(v0.z, v0.w, scale),
                                    dsa_i16x2(v1.x, v1.y, scale), dsa_i16x2(v1.z, v1.w, scale));
  if (kPred) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t"
                 "@q st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n\t}"
                 :: "l"(dst), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w), "r"(static_cast<int>(ok)) : "memory");
  } else if (ok) {
    if (kMode == 5 && scale == 0.0f) w = make_uint4(0u, 0u, 0u, 0u);
    __stcs(reinterpret_cast<uint4*>(dst), w);
  }
}

// kMode 5: the power of two for a block of values (8, or 4 in a pair's half tiles) whose largest magnitude has the bits m (0 where it is not
// finite) and its inverse (NaN there); e is clamped to [-112, 128] so both are normal floats.
__device__ __forceinline__ float2 dsa_i16_scale(unsigned int m) {
  if (m >= 0x7f800000u) return make_float2(0.0f, __int_as_float(0x7fffffff));
  const int e = min(max(static_cast<int>(m >> 23) - 126, -112), 128);  // m < 2^e
  return make_float2(__uint_as_float(static_cast<unsigned int>(141 - e) << 23),
                     __uint_as_float(static_cast<unsigned int>(113 + e) << 23));
}

// Sends a wgmma accumulator tile [64 slots, 16 kGroups columns] (a warpgroup's registers: acc[8 m + ...] holds
// columns 16 m .. 16 m + 15 of rows g and g + 8 of its warp's 16) to dkv rows rows[slot] (< 0: nothing) at column
// col0: kGroups 4 is a whole 64-column chunk, 2 the half a CTA of a pair reduces (dsa_pair_finish).
// kPredStores (the contribution modes): see dsa_store_row4. In kMode 5 a half tile's block is the 4 values a lane
// holds of a row (columns x..x+3, x = col0 + 16 gb + 8 odd + 4 (q >> 1)): exps[row, x / 4], ld / 4 bytes a row.
// kPermCols (whole tiles, not the fixed-point mode): dkv's columns are permuted within each group of 16 (real
// column 8 h + 2 q + e at 4 q + 2 h + e, see _dkv_cols_permuted): the 4 values a lane holds of a row and group
// (real columns 2 q, 2 q + 1, 2 q + 8, 2 q + 9) are then 4 consecutive floats, so the first register exchange
// (lanes q and q ^ 1) is not needed; the second still makes 8 lanes cover a row's 128-byte line. The contribution
// modes need no exchange at all: each lane stores its own 8 values of groups 2 p and 2 p + 1 of a row side by side,
// at stored columns col0 + 32 p + 8 q (group 2 p + j at + 4 j: one 16-byte store of 16-bit values, a quad's 64
// bytes contiguous; one 8-byte store per group took 1.04-1.06x longer at 576/512, H100), and in kMode 5 those 8
// values are one block, exps[row, col0 / 8 + 2 q + p] (the reduce maps the columns back, reduce_body's ``perm``).
template <int kMode, int kGroups = 4, bool kPredStores = false, bool kPermCols = false>
__device__ __forceinline__ void dsa_red_tile(const float* acc, void* dkv_raw, const int* row_slots, int slot0, int ld,
                                             int col0, int64_t* sums, void* scales_raw, long long row0) {
  const int* rows = row_slots + slot0;  // the tile's first slot (an offset, not an indexed address: no bounds test)
  static_assert(kGroups == 4 || (kGroups == 2 && kMode != 2), "half tiles: not the fixed-point mode");
  static_assert(!kPermCols || (kMode != 2 && (kGroups == 4 || kMode >= 3)),
                "permuted columns: whole tiles, or a pair's half tiles of contribution rows; not fixed point");
  float* dkv = static_cast<float*>(dkv_raw);
  const float* scales = static_cast<const float*>(scales_raw);  // kMode 2: the power of two and the limit
  unsigned char* exps = static_cast<unsigned char*>(scales_raw);  // kMode 5: the blocks' exponent bytes
  unsigned long long policy = 0;
  if (kMode == 1) asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  const float fix = kMode == 2 ? scales[0] : 1.0f;
  const float limit = kMode == 2 ? scales[1] : 0.0f;
  const int tid = threadIdx.x & 127;
  const int lane = tid & 31, q = lane & 3, g = lane >> 2;
  const int odd = q & 1, gb = g & 1;
  constexpr int kBytes = kMode == 3 ? 4 : 2;  // bytes per stored value of the contribution modes
  char* contrib = static_cast<char*>(dkv_raw);
  if (kPermCols && kMode >= 3 && kGroups == 4) {
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int slot = 16 * (tid >> 5) + 8 * half + g;
      const int row = rows[slot];
      float4 v[4];
      #pragma unroll
      for (int m = 0; m < 4; ++m)
        v[m] = make_float4(acc[8 * m + 2 * half], acc[8 * m + 2 * half + 1], acc[8 * m + 4 + 2 * half],
                           acc[8 * m + 4 + 2 * half + 1]);
      float2 sc[2] = {make_float2(1.0f, 1.0f), make_float2(1.0f, 1.0f)};
      if (kMode == 5) {
        // the lane's two blocks of the row have adjacent exponent bytes: one 16-bit store (two byte stores took
        // 6% longer at V4 H64, 1% at 576/512; H100, ab_bwd_patch.py)
        unsigned int both = 0;
        #pragma unroll
        for (int p = 0; p < 2; ++p) {
          sc[p] = dsa_i16_scale(max(dsa_absmax4_bits(v[2 * p]), dsa_absmax4_bits(v[2 * p + 1])));
          both |= (__float_as_uint(sc[p].y) >> 23) << (8 * p);
        }
        if (row >= 0)
          *reinterpret_cast<unsigned short*>(exps + (row0 + slot) * (ld / 8) + col0 / 8 + 2 * q) =
              static_cast<unsigned short>(both);
      }
      char* st = contrib + ((row0 + slot) * ld + col0 + 8 * q) * kBytes;
      #pragma unroll
      for (int p = 0; p < 2; ++p)
        dsa_store_row8<kMode, kPredStores>(st + 32 * p * kBytes, v[2 * p], v[2 * p + 1], sc[p].x, row >= 0);
    }
    return;
  }
  if (kPermCols && kMode >= 3 && kGroups == 2) {
    // a pair's half tile (det_pair_perm) is columns 32 p0 .. 32 p0 + 31 of its 64-column chunk: block p0 of the
    // whole tile's layout above, so both CTAs' rows read back as one unpaired row would
    const int chunk0 = col0 & ~63, p0 = (col0 >> 5) & 1;
    #pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int slot = 16 * (tid >> 5) + 8 * half + g;
      const int row = rows[slot];
      const float4 v0 = make_float4(acc[2 * half], acc[2 * half + 1], acc[4 + 2 * half], acc[4 + 2 * half + 1]);
      const float4 v1 = make_float4(acc[8 + 2 * half], acc[8 + 2 * half + 1], acc[12 + 2 * half], acc[12 + 2 * half + 1]);
      float2 sc = make_float2(1.0f, 1.0f);
      if (kMode == 5) {
        sc = dsa_i16_scale(max(dsa_absmax4_bits(v0), dsa_absmax4_bits(v1)));
        if (row >= 0)
          exps[(row0 + slot) * (ld / 8) + chunk0 / 8 + 2 * q + p0] =
              static_cast<unsigned char>(__float_as_uint(sc.y) >> 23);
      }
      dsa_store_row8<kMode, kPredStores>(contrib + ((row0 + slot) * ld + col0 + 8 * q) * kBytes, v0, v1, sc.x,
                                         row >= 0);
    }
    return;
  }
  #pragma unroll
  for (int half = 0; half < 2; ++half) {
    float4 v[kGroups];
    #pragma unroll
    for (int m = 0; m < kGroups; ++m) {
      const float a0 = acc[8 * m + 2 * half], a1 = acc[8 * m + 2 * half + 1];
      const float b0 = acc[8 * m + 4 + 2 * half], b1 = acc[8 * m + 4 + 2 * half + 1];
      if (kPermCols) {
        v[m] = make_float4(a0, a1, b0, b1);
        continue;
      }
      const float r0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
      const float r1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
      v[m] = odd ? make_float4(r0, r1, b0, b1) : make_float4(a0, a1, r0, r1);
    }
    const int slot = 16 * (tid >> 5) + 8 * half + (g & ~1);
    const int row_a = rows[slot], row_b = rows[slot + 1];
    float4 va[kGroups / 2], vb[kGroups / 2];  // [mp]: rows a and b at column col0 + 16 (2 mp + gb) + 8 odd + 4 (q >> 1)
    #pragma unroll
    for (int mp = 0; mp < kGroups / 2; ++mp) {
      const float4 x = v[2 * mp], y = v[2 * mp + 1];
      const float4 s = gb ? x : y;
      float4 r;
      r.x = __shfl_xor_sync(0xffffffffu, s.x, 4);
      r.y = __shfl_xor_sync(0xffffffffu, s.y, 4);
      r.z = __shfl_xor_sync(0xffffffffu, s.z, 4);
      r.w = __shfl_xor_sync(0xffffffffu, s.w, 4);
      va[mp] = gb ? r : x;
      vb[mp] = gb ? y : r;
    }
    float2 sa = make_float2(1.0f, 1.0f), sb = sa;
    if (kMode == 5) {  // this lane's values of each row (8 in a whole tile, 4 in a half): one block
      const unsigned ma = kGroups == 4 ? max(dsa_absmax4_bits(va[0]), dsa_absmax4_bits(va[kGroups / 2 - 1]))
                                       : dsa_absmax4_bits(va[0]);
      const unsigned mb = kGroups == 4 ? max(dsa_absmax4_bits(vb[0]), dsa_absmax4_bits(vb[kGroups / 2 - 1]))
                                       : dsa_absmax4_bits(vb[0]);
      sa = dsa_i16_scale(ma);
      sb = dsa_i16_scale(mb);
      constexpr int kBlock = kGroups == 4 ? 8 : 4;  // values per block
      const int blk = (kGroups == 4 ? col0 / 8 : col0 / 4) + 4 * gb + 2 * odd + (q >> 1);
      if (row_a >= 0) exps[(row0 + slot) * (ld / kBlock) + blk] = static_cast<unsigned char>(__float_as_uint(sa.y) >> 23);
      if (row_b >= 0) exps[(row0 + slot + 1) * (ld / kBlock) + blk] = static_cast<unsigned char>(__float_as_uint(sb.y) >> 23);
    }
    // each row's address once per half: the columns of pair mp are 32 mp further (an immediate offset). Computing
    // every address from the row index made ptxas re-derive the lane's column from its bits, ~10 instructions per
    // reduction under the warpgroup's register pressure: warpgroup 1's loop went from 2024 to 1631 instructions
    // (MLA H64, sm_90a SASS) and the backward 1-3% faster (H100, with the predicated red.v4 below)
    const int lane_col = col0 + 16 * gb + (kPermCols ? 4 * q : 8 * odd + 4 * (q >> 1));
    float* red_a = dkv + ((long long)row_a * ld + lane_col);
    float* red_b = dkv + ((long long)row_b * ld + lane_col);
    char* st_a = contrib + ((row0 + slot) * ld + lane_col) * kBytes;
    char* st_b = st_a + (long long)ld * kBytes;
    #pragma unroll
    for (int mp = 0; mp < kGroups / 2; ++mp) {
      if (kMode == 2) {
        dsa_fixed_quad(sums, dkv, row_a, ld, col0 + 16 * (2 * mp + gb), va[mp], fix, limit, q);
        dsa_fixed_quad(sums, dkv, row_b, ld, col0 + 16 * (2 * mp + gb), vb[mp], fix, limit, q);
        continue;
      }
      if (kMode >= 3) {
        dsa_store_row4<kMode, kPredStores>(st_a + 32 * mp * kBytes, va[mp], sa.x, row_a >= 0);
        dsa_store_row4<kMode, kPredStores>(st_b + 32 * mp * kBytes, vb[mp], sb.x, row_b >= 0);
        continue;
      }
      dsa_red4<kMode>(red_a + 32 * mp, va[mp], policy, row_a >= 0);
      dsa_red4<kMode>(red_b + 32 * mp, vb[mp], policy, row_b >= 0);
    }
  }
}

// The CTA pair of a cluster (``pair``: head blocks 2 i and 2 i + 1 of one query row) adds into the same dkv
// rows, so each CTA reduces half of every chunk (columns 32 r .. 32 r + 31 for cluster rank r) summed over
// both: it sends the peer the half the peer reduces, through distributed shared memory, and adds the half it
// receives to its own (half the L2 reductions; the sum of two fp32 values, then one reduction, where two
// reductions added them in either order). Per CTA: recv [2 slots][4][128 threads] float4 (16 KB, thread
// tid's own layout: the peer's thread tid holds the same tile positions) and bars [4] uint64: full[2] (the
// peer's half has landed: an st.async transaction of 8 KB), empty[2] (the peer's four warps have read what
// went into their slot).
__device__ __forceinline__ unsigned dsa_smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void dsa_mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "DSA_MBAR_WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra DSA_MBAR_WAIT_%=;\n\t}"
      :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void dsa_mbar_arm(unsigned bar, unsigned bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}"
               :: "r"(bar), "r"(bytes) : "memory");
}
// one thread per CTA, before the first cluster barrier: the four barriers, both full slots armed
__device__ __forceinline__ void dsa_pair_init(void* bars) {
  const unsigned b = dsa_smem_u32(bars);
  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b + 8 * i) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;" :: "r"(b + 16 + 8 * i) : "memory");
  }
  dsa_mbar_arm(b, 8192);
  dsa_mbar_arm(b + 8, 8192);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Pipelined by one chunk, so that the peer's half has a whole chunk's MMAs to land: chunk c's half goes to the
// peer (dsa_pair_send) as soon as its MMAs are done, this CTA keeps its own half in `keep` (16 registers), and
// sums and reduces it (dsa_pair_finish) after sending chunk c + 1. chunk: the running count of chunks of this
// CTA (slot c & 1, phase (c >> 1) & 1); rank: this CTA's in the pair.
template <int kRank>
__device__ __forceinline__ void dsa_pair_send_rank(const float* acc, float* keep, void* recv, void* bars, int chunk) {
  const int tid = threadIdx.x & 127;
  const int s = chunk & 1;
  const unsigned parity = (chunk >> 1) & 1;
  const unsigned full = dsa_smem_u32(bars) + 8 * s, empty = dsa_smem_u32(bars) + 16 + 8 * s;
  const unsigned slot = dsa_smem_u32(recv) + s * 8192 + tid * 16;
  const float* theirs = acc + 16 * (kRank ^ 1);  // the accumulator halves picked at compile time: no local memory
  dsa_mbar_wait(empty, parity ^ 1);  // the peer has read what this CTA put into its slot s two chunks ago
  const unsigned peer_slot = dsa_peer_saddr(slot, kRank ^ 1), peer_full = dsa_peer_saddr(full, kRank ^ 1);
  #pragma unroll
  for (int i = 0; i < 4; ++i)
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 :: "r"(peer_slot + i * 2048), "f"(theirs[4 * i]), "f"(theirs[4 * i + 1]), "f"(theirs[4 * i + 2]),
                    "f"(theirs[4 * i + 3]), "r"(peer_full) : "memory");
  #pragma unroll
  for (int i = 0; i < 16; ++i) keep[i] = acc[16 * kRank + i];
}
__device__ __forceinline__ void dsa_pair_send(const float* acc, float* keep, void* recv, void* bars, int chunk, int rank) {
  if (rank == 0) {
    dsa_pair_send_rank<0>(acc, keep, recv, bars, chunk);
  } else {
    dsa_pair_send_rank<1>(acc, keep, recv, bars, chunk);
  }
}
// keep + the peer's half of chunk `chunk` (columns col0 + 32 rank ..), reduced into the dkv rows named by the
// slots row_slots[slot0 ..]; in the contribution modes stored in the contribution rows row0 .. (one per slot of the
// pair: the sum of both head blocks, added in either order: the same fp32 value), exps their blocks' bytes
template <int kMode, bool kPredStores = false, bool kPermCols = false>
__device__ __forceinline__ void dsa_pair_finish(float* keep, void* dkv, const int* row_slots, int slot0, int ld, int col0,
                                                void* recv, void* bars, int chunk, int rank, void* exps = nullptr,
                                                long long row0 = 0) {
  const int tid = threadIdx.x & 127;
  const int s = chunk & 1;
  const unsigned full = dsa_smem_u32(bars) + 8 * s, empty = dsa_smem_u32(bars) + 16 + 8 * s;
  const unsigned slot = dsa_smem_u32(recv) + s * 8192 + tid * 16;
  dsa_mbar_wait(full, (chunk >> 1) & 1);
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    float4 r;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(slot + i * 2048) : "memory");
    keep[4 * i] += r.x;
    keep[4 * i + 1] += r.y;
    keep[4 * i + 2] += r.z;
    keep[4 * i + 3] += r.w;
  }
  __syncwarp();
  // this warp has read its part of slot s: the peer may fill it again. Release at CTA scope (the default, as
  // CUTLASS's cluster barriers): at cluster scope the arrive waited for every reduction still in flight to
  // reach L2 (V4 H128: 11.4 ms against 8.0 unpaired)
  if ((tid & 31) == 0)
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" :: "r"(dsa_peer_saddr(empty, rank ^ 1)) : "memory");
  if (tid == 0) dsa_mbar_arm(full, 8192);  // the slot's next phase (its bytes cannot come before the arrivals above)
  dsa_red_tile<kMode, 2, kPredStores, kPermCols>(keep, dkv, row_slots, slot0, ld, col0 + 32 * rank, nullptr, exps,
                                                 row0);
}
"""

# named barriers of the ws program (bar ids; TileLang numbers its own from 1 upwards per thread range)
_BAR_PDS_READY, _BAR_PDS_FREE, _BAR_KV_FREE, _BAR_WG0, _BAR_DELTA, _BAR_DQ, _BAR_WG1 = 15, 14, 13, 12, 11, 10, 9


def _head_rows_macros(T, heads: int, dv: int, DT: int, BH: int):
    """Two T.macros that stage the rows of query ``t``'s heads h0 .. h0 + BH - 1 in shared memory by the threads:
    q and dout (and q's K-only tail of DT columns), and lse' and Delta. Heads past ``heads`` read as zeros (lse'
    +inf, so their P is 0). Both backward programs use them (the ws one where q and dout do not come by TMA)."""

    @T.macro
    def q_dout(Q, dO, t, h0, q_s, do_s, qt_s):
        for i, d in T.Parallel(BH, dv):
            q_s[i, d] = T.if_then_else(h0 + i < heads, Q[t, T.min(h0 + i, heads - 1), d], 0)
            do_s[i, d] = T.if_then_else(h0 + i < heads, dO[t, T.min(h0 + i, heads - 1), d], 0)
        if DT > 0:
            for i, d in T.Parallel(BH, DT):
                qt_s[i, d] = T.if_then_else(h0 + i < heads, Q[t, T.min(h0 + i, heads - 1), dv + d], 0)

    @T.macro
    def lse_delta(Lse2, Delta, t, h0, lse_s, delta_s):
        for i in T.Parallel(BH):
            lse_s[i] = T.if_then_else(h0 + i < heads, Lse2[t, T.min(h0 + i, heads - 1)], T.infinity(T.float32))
            delta_s[i] = T.if_then_else(h0 + i < heads, Delta[t, T.min(h0 + i, heads - 1)], 0)

    return q_dout, lse_delta


def _lse_macro(T, heads: int, has_sink: bool, BH: int):
    """A T.macro that stages lse' of query ``t``'s heads h0 .. h0 + BH - 1 in shared memory from the natural-log
    Lse (and Sink), as the preprocess computes it (padded heads: +inf)."""

    @T.macro
    def lse(Lse, Sink, t, h0, lse_s):
        for i in T.Parallel(BH):
            h = T.min(h0 + i, heads - 1)
            lse_s[i] = T.if_then_else(h0 + i < heads, _lse2(T, Lse[t, h], Sink[h] if has_sink else None),
                                      T.infinity(T.float32))

    return lse


def ws_pair_supported(heads: int, dqk: int, dv: int) -> bool:
    """The ws program's pair mode: head blocks in pairs, and the 16 KB of its exchange slots beside the
    D512 tiles (the 576-wide ones leave 3 KB)."""
    return ws_supported(dqk, dv) and dqk == dv and (heads + _BLOCK_H - 1) // _BLOCK_H % 2 == 0


def ws_supported(dqk: int, dv: int) -> bool:
    """The ws program's shapes: 64-column dkv chunks over dv, and a K-only tail of 0 or 64 columns."""
    return dv % 128 == 0 and dqk - dv in (0, 64)


def _ws_body(heads, dqk, dv, dtype, store_dkv=True, prefetch=True, dq_rs=False, emit_probs=False, l2_keep=False,
             det_out=None, pair=False, skip_tail=False, wg0_chunks=0, fast_exp2=False,
             det_store_pred=False, tma_q=False, fused_pre=False, has_sink=False, dkv_perm=False, stage_dq=False,
             row_regs=0, tma_dq=False, auto_sync=True):
    """Main backward program, warp-specialised (256 threads, one CTA per query row and 64 heads).

    Warpgroup 0 gathers the selected kv rows (predicated cp.async, invalid slots zero-filled),
    computes S = q k^T and dP = dout v^T, P and dS, hands P and dS to warpgroup 1 through shared
    memory, and accumulates dq's first dv/2 columns. Warpgroup 1 accumulates the other dq columns,
    releases the kv buffer, then forms dkv = dS^T q + P^T dout in 64-column chunks (two
    accumulators: the MMAs of chunk c + 1 run while chunk c's reductions issue) and adds each
    chunk to dkv with full-line v4 reductions. The dkv products read no kv, so warpgroup 0 gathers
    and scores the next block while warpgroup 1 reduces this one.

    ``prefetch``: warpgroup 0 loads the next block's indices while the gather lands and keeps the
    slot flags in shared memory (no global index loads in the softmax). ``dq_rs``: warpgroup 0's
    dq MMA takes dS from registers, issued before dS goes to shared memory. ``store_dkv=False``
    sends no reductions (a benchmark ablation). ``emit_probs``: warpgroup 0 also writes the
    head-summed P of each slot (Probs [NHB, Tq, Kp], the indexer loss's target). ``l2_keep``: the
    reductions carry an L2 evict_last policy (the fp32 dkv lines stay in L2 while gathered rows
    stream through: long caches, where dkv outgrows L2). ``det_out`` (deterministic modes): "fixed": the
    values go to FixedSums [N, dqk] int64 instead, each times Scales[0] (a power of two; Scales[1]: the
    largest scaled value allowed, beyond which it goes to dKV as NaN) rounded to
    an integer and added with red.add.u64, so the sums do not depend on the order of the additions
    (non-finite values go to dKV as they are, see ``dsa_fixed_add``); "contrib": dKV [ND, dqk] is the
    contribution buffer [Tq, NHB, Kp] x dqk ([Tq, NHB / 2, Kp] with ``pair``) and each valid slot's values
    are stored in its own row (full-line stores from the same layout), for the reduce to sum in a fixed
    order; "contrib_bf16": the same with dKV a bf16 buffer (each value rounded to bf16: half the bytes);
    "contrib_i16": dKV an int16 buffer in block floating point, Scales [ND, dqk / 8] uint8 the exponent of
    each block of 8 values ([ND, dqk / 4], blocks of 4, with ``pair`` and not ``dkv_perm``; see
    ``dsa_red_tile``). ``pair`` (any mode but "fixed", an even number of head blocks, dqk == dv: the 16 KB it
    needs fit beside the D512 tiles, not the 576-wide ones): CTAs run in clusters of two, the two head blocks of
    one query row, which sum each dkv chunk through distributed shared memory and reduce (or, in the contribution
    modes, store)
    half of it each (``dsa_pair_send``, ``dsa_pair_finish``: pipelined by one chunk). ``skip_tail``: each query row walks
    its slot blocks only up to its last valid slot, which the CTA finds itself (``dsa_row_last_scan``): the
    blocks after it hold only -1 and add nothing (causal rows, the first tokens of packed sequences).
    ``wg0_chunks`` (0..3, not with ``pair``): warpgroup 0 forms and reduces the last ``wg0_chunks`` dkv chunks
    itself, in its S and dP accumulators once P and dS are stored, so that the two warpgroups' work per block
    is even (warpgroup 1's chunk loop is the CTA's chain; warpgroup 0 otherwise waits for it at the P/dS
    buffer).
    ``fast_exp2``: P's exponentials as ex2.approx.ftz (``kernels.fast_exp2``: one MUFU.EX2 each instead of
    exp2f's three extra instructions; 0 instead of a denormal below 2^-126).
    ``det_store_pred`` (the contribution modes): each contribution store predicated inside its asm, without a
    branch or a guard on its block's scale (``dsa_store_row4``).
    ``tma_q``: q and dout come in by TMA (one thread issues them on an mbarrier; rows past ``heads`` fall outside
    the tensor and read as zeros) while the CTA scans its row and gathers its first block; each warpgroup waits
    for them before its first MMA that reads them.
    ``fused_pre``: the program does the preprocess's work itself (no separate pass over out and dout): every
    thread takes lse' of its heads from Lse (natural log) and, ``has_sink``, Sink; warpgroup 1, idle until the
    first P and dS, loads the heads' rows of O into registers (half of them at the start, beside q and dout) and
    forms Delta = rowsum(out * dout) with dout in shared memory; warpgroup 0 waits for it before its first dS.
    Lse2 and Delta are then outputs (the sink's gradient reads them), written by the CTA of each head block.
    ``dkv_perm`` (not "fixed"; with ``pair`` only for contribution rows, ``det_pair_perm``): dKV's columns permuted
    within each group of 16, the contribution rows' within each group of 32 (see ``dsa_red_tile``'s kPermCols): half
    the register exchanges before the reductions, none before the contribution stores; the wrapper (atomic modes) or
    the reduce (contribution rows) puts them back in order.
    ``stage_dq`` (the default): dq leaves through shared memory (q's tiles, free once both warpgroups are past their last MMA) in
    16-byte stores, instead of the MMA fragments' 4-byte pieces (two to each 32-byte sector: twice the L2 writes).
    ``row_regs``: how warpgroup 0 keeps invalid slots at exactly 0 in P and dS (the same bits each way). 0: a
    slot test around each score's whole formula, under which ptxas re-issues the shared loads of lse' and Delta
    and the constant loads of the scales for every score; 1: P = 2^x with x = -inf at invalid slots (the test
    moves into the exponent's argument) and dS formed for every slot, then zeroed; 2: as 1, with x formed for
    every slot first (no load under a predicate: lse', Delta and the scales are read once per row; more
    registers, which spill in warpgroup 1 at 576/512).
    ``tma_dq`` (with ``stage_dq``): the staged dq tiles leave by TMA stores, 64 columns each, issued by one thread
    of each warpgroup, instead of every thread's 16-byte stores (the wrapper hands it an aligned dQ).
    ``auto_sync`` is not read here: the factory that compiles the program (``_jit_factories``: "ws" or
    "ws_nosync") sets whether TileLang adds its automatic syncs; as an argument it keeps the two apart in the
    caches."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    dt = T.bfloat16 if dtype == "bfloat16" else T.float16
    f32 = T.float32
    i32 = T.int32
    BH = _BLOCK_H
    BK = 64
    DT = dqk - dv
    DQ0 = dv // 2  # dq columns of warpgroup 0; warpgroup 1 has [DQ0, dqk)
    NHB = (heads + BH - 1) // BH
    pad_h = heads % BH != 0
    stage_q_dout, stage_lse_delta = _head_rows_macros(T, heads, dv, DT, BH)
    stage_lse = _lse_macro(T, heads, has_sink, BH)
    DCH = 128  # fused_pre: out's columns per fragment (32 registers a thread; the fp32 products 64)
    o_chunks = tuple(range(dv // DCH))  # a tuple: unrolled while the program is built
    O_EARLY = 2  # out's fragments loaded at the CTA's start (all four: 128 registers held there, 120-290 bytes spilled)

    def slot_ok(valid_s, Idx, t, kb, r):
        """Warpgroup 0's test of slot r of block kb: its flag (``prefetch``) or its index."""
        return (valid_s[r] != 0) if prefetch else (Idx[t, kb * BK + r] >= 0)

    @T.macro
    def load_out(O, t, h0, frag, c):
        """fused_pre: out's columns c * DCH .. (c + 1) * DCH of the CTA's heads into the register fragment ``frag``."""
        for i, d in T.Parallel(BH, DCH):
            frag[i, d] = O[t, T.min(h0 + i, heads - 1), c * DCH + d]

    @T.macro
    def store_dq(dQ, t, h0, src, src_c0, c0, width):
        """dq's columns c0 .. c0 + width of the CTA's heads (rows past ``heads`` not written) from ``src``'s columns
        src_c0 ..: an accumulator fragment, or q's shared tiles holding it (``stage_dq``)."""
        for i, d in T.Parallel(BH, width):
            if h0 + i < heads:
                dQ[t, h0 + i, c0 + d] = src[i, src_c0 + d]

    @T.macro
    def tma_store_dq(dQ, t, h0, src, src_c0, c0, width):
        """``tma_dq``: dq's columns c0 .. c0 + width from the staged tiles ``src`` (columns src_c0 ..) by TMA, one
        64-column tile per store, issued by one thread of the calling warpgroup once its writes are fenced and
        synced; rows past ``heads`` fall outside the tensor and are not written."""
        for u in range(width // 64):
            T.tma_copy(src[0:BH, src_c0 + u * 64 : src_c0 + (u + 1) * 64],
                       dQ[t, h0 : h0 + BH, c0 + u * 64 : c0 + (u + 1) * 64], leader_scope_threads=128)

    VEC = 8  # bf16 per 16-byte cp.async
    ROWS_PER_PASS = 16  # 8 threads per row, 128 threads
    passes = tuple(range(BK // ROWS_PER_PASS))
    v_chunks = tuple(range(dv // 64))
    t_chunks = tuple(range(DT // 64))
    # dkv column chunks: (first column, from the V part too); the K-only tail last
    chunks = tuple([(c * 64, True) for c in range(dv // 64)] + ([(dv, False)] if DT > 0 else []))
    NCH = len(chunks)
    chunk_ids = tuple(range(NCH))  # a tuple: the loop over it is unrolled while the program is built
    contrib_modes = {"contrib": 3, "contrib_bf16": 4, "contrib_i16": 5}
    assert det_out is None or det_out == "fixed" or det_out in contrib_modes, det_out
    fixed_point, contrib = det_out == "fixed", det_out in contrib_modes
    contrib_dt = getattr(T, _CONTRIB_DTYPES.get(det_out, "float32"))
    red_mode = contrib_modes[det_out] if contrib else 2 if fixed_point else 1 if l2_keep else 0
    pred = contrib and det_store_pred
    assert not dkv_perm or (red_mode != 2 and (contrib or not pair)), (red_mode, pair)
    red_fn = (f"dsa_red_tile<{red_mode}, 4, {str(pred).lower()}, true>" if dkv_perm
              else f"dsa_red_tile<{red_mode}, 4, true>" if pred else f"dsa_red_tile<{red_mode}>")
    assert not pair or (det_out != "fixed" and NHB % 2 == 0 and DT == 0), (det_out, NHB, DT)
    pair_fn = (f"dsa_pair_finish<{red_mode}, {str(pred).lower()}, true>" if dkv_perm
               else f"dsa_pair_finish<{red_mode}, true>" if pred else f"dsa_pair_finish<{red_mode}>")
    assert 0 <= wg0_chunks < NCH and not (pair and wg0_chunks), (wg0_chunks, NCH, pair)
    NCH1 = NCH - wg0_chunks  # warpgroup 1's chunks: chunks[:NCH1]; warpgroup 0's: chunks[NCH1:]
    chunk_ids1 = chunk_ids[:NCH1]
    wg0_ids = tuple(range(wg0_chunks))

    Tq = T.dynamic("Tq")
    N = T.dynamic("N")
    Kp = T.dynamic("Kp")
    ND = T.dynamic("ND") if contrib else N  # dKV's rows: the contribution buffer's in "contrib"

    @T.macro
    def issue_chunk(ci, q_s, qt_s, do_s, p_s, ds_s, acc):
        c0, has_v = chunks[ci]
        if has_v:
            T.wgmma_gemm(ds_s, q_s[:, c0 : c0 + 64], acc, transpose_A=True, clear_accum=True)
            T.wgmma_gemm(p_s, do_s[:, c0 : c0 + 64], acc, transpose_A=True)
        else:
            T.wgmma_gemm(ds_s, qt_s, acc, transpose_A=True, clear_accum=True)

    def scales_ptr(Scales):
        return T.address_of(Scales[0, 0] if det_out == "contrib_i16" else Scales[0])

    def contrib_row0(group, kb):
        # the first contribution row of slot block kb of contribution group ``group`` (query row t's head block,
        # t * NHB + hb, or its pair, t * NHB / 2 + hb / 2: one row per slot); none in the atomic modes
        return (T.cast(group, T.int64) * Kp + kb * BK) if contrib else T.int64(0)

    def pair_row0(t, hb, kb):
        return contrib_row0(t * (NHB // 2) + hb // 2, kb)

    @T.macro
    def reduce_chunk(ci, acc, kb, t, hb, dKV, Idx, FixedSums, Scales):
        # chunk ci of slot block kb, from either warpgroup's accumulator, to dkv (or the deterministic buffers)
        T.call_extern("handle", red_fn, acc.data, T.address_of(dKV[0, 0]),
                      T.address_of(Idx[t, 0]), kb * BK, dqk, chunks[ci][0],
                      T.address_of(FixedSums[0, 0] if fixed_point else FixedSums[0]),
                      scales_ptr(Scales), contrib_row0(t * NHB + hb, kb))

    @T.prim_func
    def dsa_bwd_ws(
        Q: T.Tensor([Tq, heads, dqk], dt),
        KV: T.Tensor([N, dqk], dt),
        dO: T.Tensor([Tq, heads, dv], dt),
        Idx: T.Tensor([Tq, Kp], i32),
        Lse2: T.Tensor([Tq, heads], f32),
        Delta: T.Tensor([Tq, heads], f32),
        dQ: T.Tensor([Tq, heads, dqk], dt),
        dKV: T.Tensor([ND, dqk], contrib_dt),
        scale: f32,
        scale_log2: f32,
        Probs: T.Tensor([NHB, Tq, Kp] if emit_probs else [1], f32),
        FixedSums: T.Tensor([N, dqk] if fixed_point else [1], T.int64),
        # "fixed": the power of two the values are scaled by and the limit; "contrib_i16": each contribution
        # row's exponent bytes, one per block of 8 values (see dsa_red_tile; per 4 values with ``pair`` in the
        # real column order: each CTA of the pair stores half of every chunk)
        Scales: (T.Tensor([ND, dqk // (4 if pair and not dkv_perm else 8)], T.uint8) if det_out == "contrib_i16"
                 else T.Tensor([2], f32)),
        # fused_pre: the forward's output, its lse (natural log, sink excluded) and the sink logits
        O: T.Tensor([Tq, heads, dv] if fused_pre else [1], dt),
        Lse: T.Tensor([Tq, heads] if fused_pre else [1], f32),
        Sink: T.Tensor([heads] if fused_pre and has_sink else [1], f32),
    ):
        # head blocks fastest (see _body): one query row's CTAs reduce into the same dkv rows at the same time
        with TC.Kernel(NHB * Tq, threads=256, prelude=_WS_PRELUDE, cluster_dims=(2, 1, 1) if pair else None) as bx:
            hb = bx % NHB
            t = bx // NHB
            q_s = T.alloc_shared([BH, dv], dt)
            do_s = T.alloc_shared([BH, dv], dt)
            kv_s = T.alloc_shared([BK, dv], dt)
            p_s = T.alloc_shared([BH, BK], dt)
            ds_s = T.alloc_shared([BH, BK], dt)
            lse_s = T.alloc_shared([BH], f32)
            delta_s = T.alloc_shared([BH], f32)
            qt_s = T.alloc_shared([BH, DT], dt) if DT > 0 else None
            kt_s = T.alloc_shared([BK, DT], dt) if DT > 0 else None

            acc_s = T.alloc_fragment([BH, BK], f32)
            acc_dp = T.alloc_fragment([BH, BK], f32)
            acc_dq0 = T.alloc_fragment([BH, DQ0], f32)
            acc_dq1 = T.alloc_fragment([BH, dv - DQ0], f32)
            acc_dqt = T.alloc_fragment([BH, DT], f32) if DT > 0 else None
            acc_kv = [T.alloc_fragment([BK, 64], f32), T.alloc_fragment([BK, 64], f32)]
            idx_reg = T.alloc_local([len(passes)], i32)
            valid_s = T.alloc_shared([BK], i32)
            ds_cast = T.alloc_fragment([BH, BK], dt) if dq_rs else None
            psum_f = T.alloc_fragment([BK], f32) if emit_probs else None
            recv_s = T.alloc_shared([2 * 4 * 128 * 4], f32) if pair else None  # the two exchange slots
            bars_s = T.alloc_shared([4], T.uint64) if pair else None
            keep = T.alloc_local([16], f32) if pair else None  # this CTA's half of the chunk in flight
            bar_q = T.alloc_barrier(1) if tma_q else None
            # fused_pre: warpgroup 1's out columns, its running out * dout products, their row sums
            o_raw = [T.alloc_fragment([BH, DCH], dt) for _ in o_chunks] if fused_pre else None
            o_acc = T.alloc_fragment([BH, DCH], f32) if fused_pre else None
            o_sum = T.alloc_fragment([BH], f32) if fused_pre else None

            tx = T.get_thread_binding()
            h0 = hb * BH
            last8_s = T.alloc_shared([8], i32) if skip_tail else None  # each warp's last valid slot + 1
            n_row = T.alloc_local([1], i32) if skip_tail else None
            if pair:
                T.call_extern("handle", "dsa_grid_dependency_wait")  # before the first global read (cluster.py)

            # both warpgroups: q, dout, lse', Delta of the 64 heads (padded heads: zeros, lse' +inf)
            if tma_q:
                T.tma_copy(Q[t, h0 : h0 + BH, 0:dv], q_s, barrier=bar_q, eviction_policy="evict_first")
                T.tma_copy(dO[t, h0 : h0 + BH, 0:dv], do_s, barrier=bar_q, eviction_policy="evict_first")
                if DT > 0:
                    T.tma_copy(Q[t, h0 : h0 + BH, dv:dqk], qt_s, barrier=bar_q, eviction_policy="evict_first")
                if T.shuffle_elect(256):
                    T.barrier_arrive(bar_q)
            else:
                stage_q_dout(Q, dO, t, h0, q_s, do_s, qt_s)
            if fused_pre:
                if tx >= 128:  # warpgroup 1 loads out's first columns now: in flight beside q and dout
                    for c in o_chunks[:O_EARLY]:
                        load_out(O, t, h0, o_raw[c], c)
                stage_lse(Lse, Sink, t, h0, lse_s)
            else:
                stage_lse_delta(Lse2, Delta, t, h0, lse_s, delta_s)
            if pair:
                if tx == 0:
                    T.call_extern("handle", "dsa_pair_init", T.address_of(bars_s[0]))
            if skip_tail:
                T.call_extern("handle", "dsa_row_last_scan<256>", T.address_of(Idx[t, 0]), Kp, T.address_of(last8_s[0]))
            T.fence_proxy_async()
            T.sync_threads()
            if skip_tail:
                n_row[0] = T.call_extern(i32, "dsa_row_blocks<256>", T.address_of(last8_s[0]), BK)
                # TileLang may place last8_s and valid_s at one address (their lifetimes do not overlap):
                # every thread has read the count before warpgroup 0 writes its first block's valid flags
                T.sync_threads()
            n_blocks = n_row[0] if skip_tail else T.ceildiv(Kp, BK)
            if pair:  # the peer's barriers are initialised before anything reaches them
                T.call_extern("handle", "dsa_cluster_sync")

            if tx < 128:
                T.clear(acc_dq0)
                lane8 = tx % 8
                if prefetch:
                    for r in passes:
                        idx_reg[r] = Idx[t, r * ROWS_PER_PASS + tx // 8]
                if fused_pre and skip_tail:
                    if n_blocks == 0:  # a row without a valid slot: Delta's barrier is still taken once
                        T.sync_threads(_BAR_DELTA, 256)
                for kb in T.serial(n_blocks):
                    if kb > 0:
                        T.sync_threads(_BAR_KV_FREE, 256)  # warpgroup 1 has read the previous kv block
                    # gather: 8 threads per row, 16 bytes each; an invalid slot's copy is predicated
                    # off (zero-filled, its address clamped to row 0)
                    if not prefetch:
                        for r in passes:
                            idx_reg[r] = Idx[t, kb * BK + r * ROWS_PER_PASS + tx // 8]
                    for r in passes:
                        row = r * ROWS_PER_PASS + tx // 8
                        ok = (idx_reg[r] >= 0) and (idx_reg[r] < N)
                        src = T.if_then_else(ok, idx_reg[r], 0)
                        if prefetch and lane8 == 0:
                            valid_s[row] = T.if_then_else(ok, 1, 0)
                        for u in v_chunks:
                            col = u * 64 + lane8 * VEC
                            T.ptx_cp_async(T.access_ptr(kv_s[row, col], "w", VEC),
                                           T.access_ptr(KV[src, col], "r", VEC), VEC, ok)
                        for u in t_chunks:
                            col = u * 64 + lane8 * VEC
                            T.ptx_cp_async(T.access_ptr(kt_s[row, col], "w", VEC),
                                           T.access_ptr(KV[src, dv + col], "r", VEC), VEC, ok)
                    T.ptx_commit_group()
                    if prefetch:
                        # the next block's indices load while this block's rows land
                        if kb + 1 < n_blocks:
                            for r in passes:
                                idx_reg[r] = Idx[t, (kb + 1) * BK + r * ROWS_PER_PASS + tx // 8]
                    T.ptx_wait_group(0)
                    T.fence_proxy_async()
                    if tma_q and kb == 0:
                        T.mbarrier_wait_parity(bar_q, 0)
                    T.sync_threads(_BAR_WG0, 128)
                    T.wgmma_gemm(q_s, kv_s, acc_s, transpose_B=True, clear_accum=True)
                    if DT > 0:
                        T.wgmma_gemm(qt_s, kt_s, acc_s, transpose_B=True)
                    T.wgmma_gemm(do_s, kv_s, acc_dp, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    # P = exp(s * scale - lse'): invalid slots and padded heads give exactly 0 (the
                    # slot test is explicit: -inf + a NaN or inf score would not stay -inf)
                    if row_regs == 2:
                        for i, r in T.Parallel(BH, BK):
                            acc_s[i, r] = acc_s[i, r] * scale_log2 - lse_s[i]
                    for i, r in T.Parallel(BH, BK):
                        if row_regs:
                            acc_s[i, r] = _ex2.exp2(T, T.if_then_else(
                                slot_ok(valid_s, Idx, t, kb, r),
                                acc_s[i, r] if row_regs == 2 else acc_s[i, r] * scale_log2 - lse_s[i],
                                -T.infinity(f32)), fast_exp2)
                        else:
                            acc_s[i, r] = T.if_then_else(
                                slot_ok(valid_s, Idx, t, kb, r),
                                _ex2.exp2(T, acc_s[i, r] * scale_log2 - lse_s[i], fast_exp2), 0.0)
                    if emit_probs:
                        # sum of P over this CTA's heads, per slot (fp32, before P is rounded)
                        T.reduce_sum(acc_s, psum_f, dim=0, clear=True)
                        for r in T.Parallel(BK):
                            Probs[hb, t, kb * BK + r] = psum_f[r]
                    T.wait_wgmma(0)
                    if fused_pre and kb == 0:
                        T.sync_threads(_BAR_DELTA, 256)  # warpgroup 1 has formed Delta
                    ds_all = row_regs > 0
                    if ds_all:  # dS for every slot, then zeroed at the invalid ones
                        for i, r in T.Parallel(BH, BK):
                            acc_dp[i, r] = acc_s[i, r] * (acc_dp[i, r] - delta_s[i]) * scale
                    for i, r in T.Parallel(BH, BK):
                        acc_dp[i, r] = T.if_then_else(
                            slot_ok(valid_s, Idx, t, kb, r),
                            acc_dp[i, r] if ds_all else acc_s[i, r] * (acc_dp[i, r] - delta_s[i]) * scale, 0.0)
                    if dq_rs:
                        # dq[:, :DQ0] += dS k from registers, in flight while P and dS are stored
                        T.copy(acc_dp, ds_cast)
                        T.wgmma_gemm(ds_cast, kv_s[:, 0:DQ0], acc_dq0)
                    if kb > 0:
                        T.sync_threads(_BAR_PDS_FREE, 256)  # warpgroup 1 is done with the previous P, dS
                    T.copy(acc_s, p_s)
                    T.copy(acc_dp, ds_s)
                    T.fence_proxy_async()
                    T.named_barrier_arrive(_BAR_PDS_READY, 256)
                    if not dq_rs or wg0_chunks > 0:
                        T.sync_threads(_BAR_WG0, 128)
                    if not dq_rs:
                        # dq[:, :DQ0] += dS k   (scale folded into dS)
                        T.wgmma_gemm(ds_s, kv_s[:, 0:DQ0], acc_dq0)
                    if wg0_chunks > 0:
                        # this warpgroup's dkv chunks, in the S and dP accumulators (free once P and dS are
                        # stored): the MMAs of all of them queue behind the dq MMA, each reduced once it lands
                        own = (acc_s, acc_dp)
                        for j in wg0_ids:
                            if j < 2:
                                issue_chunk(NCH1 + j, q_s, qt_s, do_s, p_s, ds_s, own[j])
                        for j in wg0_ids:  # chunk j + 1 is in flight while chunk j reduces
                            if j + 1 < wg0_chunks:
                                T.wait_wgmma(2 if chunks[NCH1 + j + 1][1] else 1)
                            else:
                                T.wait_wgmma(0)
                            if store_dkv:
                                reduce_chunk(NCH1 + j, own[j % 2], kb, t, hb, dKV, Idx, FixedSums, Scales)
                            if j + 2 < wg0_chunks:
                                issue_chunk(NCH1 + j + 2, q_s, qt_s, do_s, p_s, ds_s, own[j % 2])
                    T.wait_wgmma(0)
                if stage_dq:
                    T.sync_threads(_BAR_DQ, 256)  # both warpgroups are past the last MMA that reads q_s
                    T.copy(acc_dq0, q_s[:, 0:DQ0])
                    if tma_dq:
                        T.fence_proxy_async()  # the tiles' writes visible to the TMA unit
                    T.sync_threads(_BAR_WG0, 128)
                if tma_dq:
                    tma_store_dq(dQ, t, h0, q_s, 0, 0, DQ0)
                    T.tma_store_wait()  # the tiles are read before the CTA may exit
                else:
                    store_dq(dQ, t, h0, q_s if stage_dq else acc_dq0, 0, 0, DQ0)
            else:
                if fused_pre:
                    # Delta = rowsum(out * dout) in fp32 while warpgroup 0 gathers and scores the first block: out's
                    # other columns, then the products with dout's summed per thread and across the threads of each
                    # row; an empty row (lse' +inf) gets 0, whatever dout holds
                    for c in o_chunks[O_EARLY:]:
                        load_out(O, t, h0, o_raw[c], c)
                    if tma_q:
                        T.mbarrier_wait_parity(bar_q, 0)
                    T.clear(o_acc)
                    for c in o_chunks:
                        for i, d in T.Parallel(BH, DCH):
                            o_acc[i, d] += T.if_then_else(h0 + i < heads, T.cast(o_raw[c][i, d], f32), 0.0) * T.cast(
                                do_s[i, c * DCH + d], f32)
                    T.reduce_sum(o_acc, o_sum, dim=1)
                    for i in T.Parallel(BH):
                        delta_s[i] = T.if_then_else(lse_s[i] == T.infinity(f32), 0.0, o_sum[i])
                        if h0 + i < heads:
                            Delta[t, h0 + i] = T.if_then_else(lse_s[i] == T.infinity(f32), 0.0, o_sum[i])
                            Lse2[t, h0 + i] = lse_s[i]
                    T.named_barrier_arrive(_BAR_DELTA, 256)
                elif tma_q:
                    T.mbarrier_wait_parity(bar_q, 0)
                T.clear(acc_dq1)
                if DT > 0:
                    T.clear(acc_dqt)
                for kb in T.serial(n_blocks):
                    T.sync_threads(_BAR_PDS_READY, 256)
                    T.wgmma_gemm(ds_s, kv_s[:, DQ0:dv], acc_dq1)
                    if DT > 0:
                        T.wgmma_gemm(ds_s, kt_s, acc_dqt)
                    issue_chunk(0, q_s, qt_s, do_s, p_s, ds_s, acc_kv[0])
                    T.wait_wgmma(2 if chunks[0][1] else 1)  # dq done: the kv block is free
                    if kb + 1 < n_blocks:
                        T.named_barrier_arrive(_BAR_KV_FREE, 256)
                    for ci in chunk_ids1:
                        if ci + 1 < NCH1:
                            issue_chunk(ci + 1, q_s, qt_s, do_s, p_s, ds_s, acc_kv[(ci + 1) % 2])
                            T.wait_wgmma(2 if chunks[ci + 1][1] else 1)
                        else:
                            T.wait_wgmma(0)
                            if kb + 1 < n_blocks:
                                T.named_barrier_arrive(_BAR_PDS_FREE, 256)
                        if store_dkv and pair:
                            # send this chunk's half, then sum and reduce the previous chunk's (the last of the
                            # previous block at ci 0: its kv rows are that block's)
                            if ci > 0 or kb > 0:
                                T.call_extern("handle", pair_fn, keep.data,
                                              T.address_of(dKV[0, 0]),
                                              T.address_of(Idx[t, 0]), (kb if ci > 0 else kb - 1) * BK, dqk,
                                              chunks[ci - 1][0] if ci > 0 else chunks[NCH - 1][0],
                                              T.address_of(recv_s[0]), T.address_of(bars_s[0]), kb * NCH + ci - 1,
                                              hb % 2, scales_ptr(Scales), pair_row0(t, hb, (kb if ci > 0 else kb - 1)))
                            T.call_extern("handle", "dsa_pair_send", acc_kv[ci % 2].data, keep.data,
                                          T.address_of(recv_s[0]), T.address_of(bars_s[0]), kb * NCH + ci, hb % 2)
                        elif store_dkv:
                            reduce_chunk(ci, acc_kv[ci % 2], kb, t, hb, dKV, Idx, FixedSums, Scales)
                if stage_dq:
                    T.sync_threads(_BAR_DQ, 256)
                    T.copy(acc_dq1, q_s[:, DQ0:dv])
                    if DT > 0:
                        T.copy(acc_dqt, qt_s)
                    if tma_dq:
                        T.fence_proxy_async()
                    T.sync_threads(_BAR_WG1, 128)
                if tma_dq:
                    tma_store_dq(dQ, t, h0, q_s, DQ0, DQ0, dv - DQ0)
                    if DT > 0:
                        tma_store_dq(dQ, t, h0, qt_s, 0, dv, DT)
                    T.tma_store_wait()
                else:
                    store_dq(dQ, t, h0, q_s if stage_dq else acc_dq1, DQ0 if stage_dq else 0, DQ0, dv - DQ0)
                    if DT > 0:
                        store_dq(dQ, t, h0, qt_s if stage_dq else acc_dqt, 0, dv, DT)
            if pair:
                if tx >= 128 and store_dkv and n_blocks > 0:  # the last chunk's half
                    T.call_extern("handle", pair_fn, keep.data, T.address_of(dKV[0, 0]),
                                  T.address_of(Idx[t, 0]), (n_blocks - 1) * BK, dqk, chunks[NCH - 1][0],
                                  T.address_of(recv_s[0]), T.address_of(bars_s[0]), n_blocks * NCH - 1, hb % 2,
                                  scales_ptr(Scales), pair_row0(t, hb, n_blocks - 1))
                # no CTA leaves while its peer may still signal its barriers
                T.call_extern("handle", "dsa_cluster_sync")

    return dsa_bwd_ws


# ----------------------------------------------------------------------------------------------
# Building and caching
# ----------------------------------------------------------------------------------------------

_PASS_CONFIGS_MAIN = {
    "tl.disable_tma_lower": True,
    "tl.disable_warp_specialized": True,
}


#: the ws program's arguments (:func:`_main_kernel` builds them; the last one selects the factory)
_WS_ARGS = len(inspect.signature(_ws_body).parameters)
_WS_PERM_AT = list(inspect.signature(_ws_body).parameters).index("dkv_perm")


@functools.cache
def _jit_factories(key):
    import tilelang

    target = _target_from_key(key)
    main = tilelang.jit(target=target, pass_configs=_PASS_CONFIGS_MAIN)(_main_body)
    ws = tilelang.jit(target=target, pass_configs=_PASS_CONFIGS_MAIN)(_ws_body)
    no_sync = {**_PASS_CONFIGS_MAIN, tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
    ws_nosync = tilelang.jit(target=target, pass_configs=no_sync)(_ws_body)
    pre = tilelang.jit(target=target)(_preprocess_body)
    return {"preprocess": pre, "main": main, "ws": ws, "ws_nosync": ws_nosync}


def _target_from_key(key):
    if isinstance(key, tuple):
        return dict(key)
    return key


_COMPILED: dict = {}
_LOCK = threading.Lock()


def _get(kind: str, target, *args):
    if kind == "reduce":  # shared with the indexer loss's deterministic d_index_k
        return build_reduce(*args, target=target)

    def build():
        # the ws program's last argument (auto_sync): TileLang's automatic syncs, a pass option of its factory
        if kind == "ws" and len(args) != _WS_ARGS:
            raise ValueError(f"the ws program takes {_WS_ARGS} arguments, got {len(args)}")
        prog = _jit_factories(target_key(target))["ws_nosync" if kind == "ws" and not args[-1] else kind](*args)
        logger.info("dsa_plugins: compiled sparse attention bwd %s kernel %s for %s", kind, args, target)
        return prog

    return compiled_once(_COMPILED, _LOCK, (kind, target_key(target), args), f"sparse attention backward {kind}", build)


# det_mode -> the ws program's det_out
_WS_DET_OUT = {"fixed": "fixed", "contrib_ws": "contrib", "contrib_bf16": "contrib_bf16", "contrib_i16": "contrib_i16"}


def _contrib_dtype(cfg: dict) -> str:
    """The contribution buffer's dtype of the contribution modes."""
    return _CONTRIB_DTYPES.get(cfg["det_mode"], "float32")


def _uses_ws(cfg: dict, deterministic: bool) -> bool:
    return cfg["schedule"] == "ws" and (not deterministic or cfg["det_mode"] != "contrib")


def _det_pair(cfg: dict, deterministic: bool) -> bool:
    """Whether the deterministic program stores one contribution row per slot of a head-block pair."""
    return deterministic and cfg["det_pair"] and cfg["det_mode"] in _CONTRIB_WS_MODES and cfg["store_dkv"]


def _fused_pre(cfg: dict, deterministic: bool) -> bool:
    """Whether the ws program forms lse' and Delta itself (no preprocess launch before it)."""
    return cfg["ws_fused_pre"] and _uses_ws(cfg, deterministic) and not (deterministic and cfg["det_mode"] == "fixed")


def _dkv_perm(cfg: dict, deterministic: bool, pair: bool) -> bool:
    """Whether the ws program adds into dkv, or stores its contribution rows, with the columns permuted
    (``ws_dkv_perm``: unpaired, or the deterministic pair's contribution rows with ``det_pair_perm``; not "fixed")."""
    return (cfg["ws_dkv_perm"] and _uses_ws(cfg, deterministic)
            and (not pair or (deterministic and cfg["det_pair_perm"]))
            and not (deterministic and cfg["det_mode"] == "fixed"))


def _dkv_cols_permuted(x: Tensor, inverse: bool = False) -> Tensor:
    """``x`` [..., D] (D a multiple of 16) with its columns in the order ``ws_dkv_perm`` adds them: in each group of
    16, real column 8 h + 2 q + e (h < 2, q < 4, e < 2) at 4 q + 2 h + e; ``inverse``: back to the real order."""
    g = x.unflatten(-1, (-1, 4, 2, 2) if inverse else (-1, 2, 4, 2))
    return g.transpose(-3, -2).flatten(-4)


def _dkv_cols_restored(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``_dkv_cols_permuted(x, inverse=True).to(dtype)`` in one pass over ``x``: a new contiguous tensor (the
    strided read and the cast are one copy; the reshape of the other form copies, and a cast after it again)."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    out.unflatten(-1, (-1, 2, 4, 2)).copy_(x.unflatten(-1, (-1, 4, 2, 2)).transpose(-3, -2))
    return out


def _main_kernel(cfg: dict, deterministic: bool, emit_probs: bool = False) -> tuple:
    """(program kind, compile args) of the main kernel the wrapper launches."""
    if _uses_ws(cfg, deterministic):
        pair = (cfg["ws_pair"] and not deterministic and cfg["store_dkv"]) or _det_pair(cfg, deterministic)
        return "ws", (cfg["heads"], cfg["dqk"], cfg["dv"], cfg["dtype"], cfg["store_dkv"], cfg["ws_prefetch"],
                      cfg["ws_dq_rs"], bool(emit_probs), cfg["l2_keep"] and not deterministic,
                      _WS_DET_OUT[cfg["det_mode"]] if deterministic else None, pair, cfg["skip_tail"],
                      0 if pair else cfg["ws_wg0_chunks"],  # the pair's exchange stays in warpgroup 1
                      cfg["fast_exp2"],
                      cfg["det_store_pred"] and deterministic and cfg["det_mode"] in _CONTRIB_WS_MODES,
                      cfg["ws_tma_q"], _fused_pre(cfg, deterministic),
                      cfg["has_sink"] and _fused_pre(cfg, deterministic), _dkv_perm(cfg, deterministic, pair),
                      cfg["ws_stage_dq"], cfg["ws_row_regs"], cfg["ws_tma_dq"],
                      # the head-summed P's cross-warp sums and the pair's exchange need TileLang's syncs
                      cfg["ws_auto_sync"] or bool(emit_probs) or pair)
    return "main", _main_args(cfg, deterministic, emit_probs)


def _main_args(cfg: dict, deterministic: bool, emit_probs: bool = False) -> tuple:
    # every argument of _main_body, positionally (one cache key per program)
    return (cfg["heads"], cfg["dqk"], cfg["dv"], cfg["dtype"], cfg["block_k"], cfg["num_stages"],
            cfg["threads"], cfg["dkv_chunk"], bool(deterministic), cfg["store_dkv"], cfg["stage_atomics"],
            bool(cfg["overlap"] and not deterministic), bool(emit_probs), cfg["skip_tail"], cfg["l2_keep"])


#: The programs of one configuration, by name (each compiled separately: warmup runs them in parallel).
BWD_PROGRAMS = ("preprocess", "preprocess_det", "main", "main_probs", "main_det", "main_det_probs", "reduce")


def _program_key(cfg: dict, name: str) -> tuple:
    """(program kind, compile args) of program ``name`` of :data:`BWD_PROGRAMS` for a normalised config:
    the preprocess (``_det``: with the maxima of the "fixed" deterministic mode), the main kernel (atomic
    or deterministic ``_det``, with the head-summed P output ``_probs`` or not) or the contribution reduce."""
    if name in ("preprocess", "preprocess_det"):
        return "preprocess", _preprocess_args(cfg, name == "preprocess_det")
    if name == "reduce":  # with det_pair one contribution row per pair of head blocks
        nhb, pair = (cfg["heads"] + _BLOCK_H - 1) // _BLOCK_H, _det_pair(cfg, True)
        perm = _dkv_perm(cfg, True, pair)  # rows with permuted columns (the key grows only then)
        # (no exponent bytes in the other dtypes; the pair's permuted rows have the unpaired rows' blocks of 8)
        block = 4 if pair and _contrib_dtype(cfg) == "int16" and not perm else 8
        return "reduce", (cfg["dqk"], nhb // 2 if pair else nhb, _contrib_dtype(cfg), block) + ((True,) if perm else ())
    if name not in BWD_PROGRAMS:
        raise ValueError(f"unknown backward program {name!r}; known: {BWD_PROGRAMS}")
    return _main_kernel(cfg, "_det" in name, name.endswith("_probs"))


def build_bwd_program(config: dict, name: str, target="auto"):
    """Compile one program of ``config`` (a name of :data:`BWD_PROGRAMS`, see :func:`_program_key`)."""
    kind, args = _program_key(_normalise_config(config), name)
    return _get(kind, target, *args)


def bwd_program_names(config: dict) -> tuple:
    """The programs of :data:`BWD_PROGRAMS` that ``config`` runs (the reduce only with the contribution
    modes, the preprocess with maxima only with "fixed")."""
    cfg = _normalise_config(config)
    fixed = cfg["det_mode"] == "fixed"
    skip = {"reduce" if fixed else "preprocess_det"}
    # the preprocess only where a program of this config does not form lse' and Delta itself ("fixed" has its own)
    if _fused_pre(cfg, False) and (_fused_pre(cfg, True) or fixed):
        skip.add("preprocess")
    return tuple(n for n in BWD_PROGRAMS if n not in skip)


def build_bwd_kernels(config: dict, target="auto") -> dict:
    """Compile every program one configuration needs (:func:`bwd_program_names`). Returns {name: kernel}."""
    return {name: build_bwd_program(config, name, target) for name in bwd_program_names(config)}


# ----------------------------------------------------------------------------------------------
# Python entry point
# ----------------------------------------------------------------------------------------------


def runtime_target(device: torch.device):
    """The compile target for a CUDA device: explicit sm_90a on Hopper (the same cache key as a
    CPU build for that target), TileLang's auto-detection elsewhere."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(idx) == (9, 0):
        return {"kind": "cuda", "arch": "sm_90a"}
    return "auto"


def _check(name, t, shape, dtype=None, device=None):
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s for i, s in enumerate(shape)):
        raise ValueError(f"{name} must have shape {tuple('*' if s is None else s for s in shape)}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")


def _prepare_indices(indices: Tensor, skv: int, block_k: int) -> Tensor:
    """[B,S,K] -> [B*S, Kp] int32 global kv rows (b*Skv + j), -1 for invalid and padding."""
    K = indices.shape[-1]
    kp = max(block_k, (K + block_k - 1) // block_k * block_k)
    g = global_rows(indices, skv)
    if kp != K:
        g = torch.nn.functional.pad(g, (0, kp - K), value=-1)
    return g.contiguous()


def unsupported_reason(num_heads: int, dqk: int, dv: int, has_sink: bool, dtype: torch.dtype) -> str | None:
    """None when the backward family runs this configuration, else a one-line reason (the ops
    layer falls back to the reference under backend="auto" and raises under "tilelang")."""
    try:
        _normalise_config({"heads": num_heads, "dqk": dqk, "dv": dv, "has_sink": has_sink,
                           "dtype": str(dtype).replace("torch.", "")})
    except ValueError as exc:
        return str(exc)
    return None


def sparse_attention_bwd(q, kv, indices, out, lse, dout, scale: float, sink=None, dv: int | None = None,
                         deterministic: bool = False, *, config: dict | None = None, return_probs: bool = False,
                         dq=None, dkv=None, dkv_dtype: torch.dtype | None = None):
    """Backward of sparse attention over a shared latent.

    q [B,S,H,Dqk] bf16/fp16; kv [B,Skv,Dqk] q.dtype; indices [B,S,K] int32 (any K >= 1; entries
    < 0 or >= Skv are invalid, never read); out [B,S,H,dv] q.dtype; lse [B,S,H] fp32 natural log,
    sink excluded, +inf for rows with no valid index; dout like out; sink [H] fp32 or None; dv
    defaults to Dqk. Returns dq [B,S,H,Dqk] q.dtype, dkv [B,Skv,Dqk] float32 or ``dkv_dtype`` (zero-initialised
    here unless given, accumulated with fp32 atomics), dsink [H] fp32 or None.

    deterministic=True gives bitwise-reproducible results. With ``det_mode`` "contrib" (the default for
    head dims the ws program does not take; on its shapes the default is "contrib_i16", below) the plain
    program writes each slot's kv gradient (per block of 64 heads) into a contribution buffer, a chunk
    of query rows at a time (buffer <= DSA_PLUGINS_BWD_DET_BUDGET_MB, 2 GiB by default); a stable sort
    gives each kv row its contributions in a fixed order and a reduce kernel sums them (H100, B1 S4096
    Skv8192: MLA H64 k2048 21.1 ms against 8.5 ms atomic, H128 41.6 / 16.6, V4 H128 k1024 17.4 / 8.2).
    With ``det_mode`` "fixed" (the ws program's shapes: every model shape) each dkv value is multiplied
    by a power of two chosen on the device from the inputs' magnitudes, rounded to int64 and added with
    integer reductions, whose sums do not depend on the order of the additions; the sums come back as
    fp32 at the end. The scale keeps every sum under 2**60 and rounds each value to a step of ~2**-33 to
    2**-35 of a typical sum (CPU check, H128 576/512, 24-64 query rows), one bit coarser per doubling
    of the slots naming one kv row (fp32 atomics round each partial sum to 2**-24 of itself).
    Non-finite values reach dkv as they are; a value beyond the bound (an lse far below the scores')
    makes its element NaN. It needs no buffer
    beyond [Skv, Dqk] int64 but is slower (41.1 / 74.7 / 35.6 ms on the shapes above). On the ws
    program's shapes the contribution rows come from the ws program, by default as int16 with a power of
    two per 8 values ("contrib_i16": 15.6 / 32.5 / 13.8 ms then; 12.1 / 24.4 / 11.2 ms against 7.25 / 14.4 / 7.16
    atomic on 63f91d6, the same run as cuDNN's; dkv within 5e-5 of the fp32 sums; a block
    with a value that is not finite sums to NaN), or as fp32 (``det_mode`` "contrib_ws": 17.0 / 33.9 /
    15.0 ms) or bf16 ("contrib_bf16": 12.7 / 25.3 / 11.6 ms, each contribution rounded to bf16:
    within 1.7e-3 of the fp32 sums). Where two head blocks of a row can pair (dqk == dv, an even number
    of them: DeepSeek-V4 H128) they sum each chunk in a 2-CTA cluster first and store one row per slot of
    the pair (``det_pair``; by default in the unpaired rows' permuted layout, ``det_pair_perm``): half the rows
    to reduce, 1.44x the default's time (H100, V4 H128 k1024). dq and dsink are deterministic in every mode (no atomics).

    return_probs=True adds a fourth result, probs [B,S,K] fp32: sum over heads of the attention
    probabilities P[h, j] = exp(scale * s_hj - lse'_h) of each slot (lse' with the sink), 0 for
    invalid slots; the indexer KL loss's target, taken from the P the backward recomputes anyway.

    ``dq`` [B,S,H,Dqk] q.dtype is written in place of a new tensor; ``dkv`` [B,Skv,Dqk] fp32 is
    added to (not zeroed), so query chunks of one cache accumulate into one buffer (both
    contiguous). The ops layer uses them to run long inputs in chunks without concatenating.
    ``dkv_dtype`` (without ``dkv``): the dtype dkv comes back in, float32 by default; the ops layer asks for
    kv's, and the fp32 sums are cast in the pass that puts ``ws_dkv_perm``'s columns back in order (the same
    bits as casting the fp32 result, one read of the fp32 buffer instead of three).

    ``config`` overrides tuning keys (block_k, dkv_chunk, overlap, ...);
    the env variable DSA_PLUGINS_BWD_TUNING (JSON) does the same for experiments.
    """
    B, S, H, Dqk = q.shape
    dv = Dqk if dv is None else int(dv)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bfloat16 or float16, got {q.dtype}")
    dev = q.device
    _check("kv", kv, (B, None, Dqk), q.dtype, dev)
    Skv = kv.shape[1]
    _check("indices", indices, (B, S, None), None, dev)
    if indices.shape[2] < 1:
        raise ValueError("indices must have at least one slot (K >= 1)")
    _check("out", out, (B, S, H, dv), q.dtype, dev)
    _check("dout", dout, (B, S, H, dv), q.dtype, dev)
    _check("lse", lse, (B, S, H), torch.float32, dev)
    if sink is not None:
        _check("sink", sink, (H,), None, dev)
        sink = sink.float().contiguous()

    dq = output_buffer("dq", dq, (B, S, H, Dqk), q.dtype, dev)
    if dkv_dtype is not None and dkv is not None:
        raise ValueError("dkv_dtype is for a dkv of ours: a given dkv is float32 and is added to")
    if dkv_dtype is not None and dkv_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dkv_dtype must be float32, bfloat16 or float16, got {dkv_dtype}")
    dkv_dtype = torch.float32 if dkv_dtype is None else dkv_dtype
    dkv_zero = dkv is None  # a buffer of ours: zeros in any column order
    dkv = output_buffer("dkv", dkv, (B, Skv, Dqk), torch.float32, dev, zeros=True)

    cfg = _normalise_config({"heads": H, "dqk": Dqk, "dv": dv, "has_sink": sink is not None,
                             "dtype": str(q.dtype).replace("torch.", ""), **(config or {})})
    if B * S == 0 or Skv == 0:
        dsink = torch.zeros(H, device=dev, dtype=torch.float32) if sink is not None else None
        res = (dq.zero_(), dkv.to(dkv_dtype), dsink)
        if return_probs:
            res += (torch.zeros(B, S, indices.shape[2], device=dev, dtype=torch.float32),)
        return res
    BK = cfg["block_k"]
    target = runtime_target(dev)
    T_ = B * S
    N = B * Skv

    # 16-byte vector loads, cp.async gathers and TMA: aligned bases (a misaligned view is copied)
    q2 = aligned_operand(q.reshape(T_, H, Dqk))
    kv2 = aligned_operand(kv.reshape(N, Dqk))
    o2 = aligned_operand(out.reshape(T_, H, dv))
    do2 = aligned_operand(dout.reshape(T_, H, dv))
    lse2_in = lse.reshape(T_, H).contiguous()
    idx = _prepare_indices(indices, Skv, BK)
    # dq leaves in 16-byte stores (or by TMA) and dkv takes v4 reductions: given buffers off 16 bytes go through copies
    dq_w, dkv_w = aligned_output(dq), aligned_output(dkv, keep=True)

    with torch.cuda.device(dev):
        res, permuted = _launch(q2, kv2, o2, do2, lse2_in, idx, sink, cfg, target, scale, deterministic, B, S, Skv,
                                return_probs, dq_w.view(T_, H, Dqk), dkv_w.view(N, Dqk), dkv_zero=dkv_zero)
    # a buffer of ours holds ws_dkv_perm's column order still: back in order and cast in one pass
    dkv_out = _dkv_cols_restored(res[1], dkv_dtype) if permuted else res[1].to(dkv_dtype)
    res = (res[0] if dq_w is dq else dq.copy_(res[0]), dkv_out if dkv_w is dkv else dkv.copy_(dkv_out)) + res[2:]
    if return_probs:
        probs = res[3]
        probs = probs[0] if probs.shape[0] == 1 else probs.sum(0)  # head blocks, fixed order
        res = res[:3] + (probs[:, : indices.shape[2]].reshape(B, S, indices.shape[2]),)
    return res


def _probs_arg(probs, device):
    """The Probs argument of the main program: the buffer, or a placeholder."""
    return probs if probs is not None else zeros_arg(1, torch.float32, device)


# fixed-point sums are scaled to stay below 2**_FIX_BITS: three bits of headroom under int64's range
_FIX_BITS = 60


def _finite_abs_max(t: Tensor) -> Tensor:
    """max |t| over its finite entries, as a float64 scalar tensor (0 for an empty tensor)."""
    if t.numel() == 0:
        return torch.zeros((), device=t.device, dtype=torch.float64)
    return t.abs().nan_to_num_(0.0, 0.0, 0.0).amax().double()


def _no_fixed_point(device):
    """The ws program's FixedSums and FixScale arguments where it adds no fixed-point values."""
    return zeros_arg(1, torch.int64, device), zeros_arg(2, torch.float32, device)


def _fixed_point_scale(maxima, kv2, idx, n_rows, heads, dv, scale):
    """(fix_limit [2] fp32, unfix [1] fp64): the power of two the deterministic "fixed" mode scales dkv
    values by before rounding them to int64, the largest scaled value it may add, and the inverse of the
    scale; computed on the device (no host sync).

    A bound on every partial sum of one dkv element: each value (one slot, one head block) is
    sum_h dS_h q_h + P_h dout_h over <= 64 heads, with P <= 1 (2 allowed: an lse a little below the
    scores'), |dS| <= P (|dP| + |Delta|) |scale|, |dP| <= dv max|dout| max|kv|, |Delta| <= dv max|out|
    max|dout| (maxima over finite entries, from the preprocess's ``maxima`` [Tq, NHB16, threads, 3]
    of q, out, dout; values made from non-finite ones go to dkv as they are); a kv row gets one value
    per slot naming it (duplicates included) and head block. fix = 2**floor(_FIX_BITS - log2(bound)):
    no sum reaches int64's range, and each value is rounded to a step of bound * 2**-60 (fp32 atomics
    round each partial sum to 2**-24 of itself). The limit, 2**60 over the most values one row gets,
    catches a value beyond the bound (an lse far below the scores'): it goes to dkv as NaN."""
    q_max, out_max, dout_max = maxima.view(-1, 3).amax(0).double().unbind()
    kv_max = _finite_abs_max(kv2)
    keys = keys_last_invalid(idx, n_rows)
    counts = torch.zeros(n_rows + 1, device=idx.device, dtype=torch.int32)
    counts.index_add_(0, keys, torch.ones_like(keys))
    per_row = counts[:n_rows].amax().double().clamp(min=1) * ((heads + _BLOCK_H - 1) // _BLOCK_H)
    ds_max = 2.0 * abs(scale) * dv * dout_max * (kv_max + out_max) * 1.05
    per_value = min(heads, _BLOCK_H) * (q_max * ds_max + 2.0 * dout_max) * 1.05
    # a zero bound (nothing to add) takes any scale; the clamp keeps fix and unfix finite in fp32
    exp = torch.floor(_FIX_BITS - torch.log2(per_row * per_value)).clamp(-120, 120)
    limit = 2.0**_FIX_BITS / per_row
    return torch.stack([torch.exp2(exp), limit]).float(), torch.exp2(-exp).view(1)


def _launch(q2, kv2, o2, do2, lse2_in, idx, sink, cfg, target, scale, deterministic, B, S, Skv,
            return_probs, dq, dkv, dkv_zero=False):
    """Run the programs: (results, whether dkv's columns are left permuted). ``dq`` [T, H, Dqk] is written, ``dkv``
    [N, Dqk] fp32 is added to (``dkv_zero``: it holds
    zeros)."""
    dev = q2.device
    T_, H, Dqk = q2.shape
    dv = cfg["dv"]
    N = kv2.shape[0]
    Kp = idx.shape[1]
    kind, args = _main_kernel(cfg, deterministic, return_probs)
    fixed = deterministic and cfg["det_mode"] == "fixed"
    left_permuted = False
    delta = torch.empty(T_, H, device=dev, dtype=torch.float32)
    lse2 = torch.empty(T_, H, device=dev, dtype=torch.float32)
    sink_arg = sink if sink is not None else torch.zeros(H, device=dev, dtype=torch.float32)
    fuse = _fused_pre(cfg, deterministic)
    if fuse:  # the ws program writes delta and lse2 itself
        fused = (o2, lse2_in, sink_arg if sink is not None else zeros_arg(1, torch.float32, dev))
    else:
        pre = _get("preprocess", target, *_preprocess_args(cfg, fixed))
        maxima_shape = ((T_ if fixed else 1), (H + _PRE_BLOCK_H - 1) // _PRE_BLOCK_H, _PRE_THREADS, 3)
        maxima = torch.empty(maxima_shape, device=dev, dtype=torch.float32)
        q_arg = q2 if fixed else torch.empty(1, H, 1, device=dev, dtype=q2.dtype)  # placeholder: not read
        pre(o2, do2, lse2_in, sink_arg, delta, lse2, q_arg, maxima)
        fused = (zeros_arg(1, q2.dtype, dev), zeros_arg(1, torch.float32, dev), zeros_arg(1, torch.float32, dev))

    s = float(scale)
    main = _get(kind, target, *args)
    nhb = (H + _BLOCK_H - 1) // _BLOCK_H
    skip = cfg["skip_tail"]
    # skipped blocks write no probabilities: they start at zero
    probs = (torch.zeros if skip else torch.empty)(nhb, T_, Kp, device=dev, dtype=torch.float32) if return_probs else None
    # the plain program reads each row's trip count; the ws program finds it itself
    blocks = row_blocks(idx, cfg["block_k"]) if skip and kind == "main" else zeros_arg(1, torch.int32, dev)
    if fixed:
        fix, unfix = _fixed_point_scale(maxima, kv2, idx, N, H, dv, s)
        sums = torch.zeros(N, Dqk, device=dev, dtype=torch.int64)
        main(q2, kv2, do2, idx, lse2, delta, dq, dkv, s, s * _LOG2E, _probs_arg(probs, dev), sums, fix, *fused)
        dkv.add_((sums.to(torch.float64) * unfix).to(torch.float32))
    elif kind == "ws" and not deterministic:
        perm = args[_WS_PERM_AT]  # ws_dkv_perm: the program adds into permuted columns
        if perm and not dkv_zero:
            dkv.copy_(_dkv_cols_permuted(dkv))
        main(q2, kv2, do2, idx, lse2, delta, dq, dkv, s, s * _LOG2E, _probs_arg(probs, dev), *_no_fixed_point(dev),
             *fused)
        if perm and not dkv_zero:
            dkv.copy_(_dkv_cols_permuted(dkv, inverse=True))
        left_permuted = perm and dkv_zero  # the caller restores its own buffer (and casts it) in one pass
    elif not deterministic:
        main(q2, kv2, do2, idx, lse2, delta, dq, dkv, s, s * _LOG2E, _probs_arg(probs, dev), blocks)
    else:  # the contribution modes: "contrib" (the plain program) and "contrib_ws"
        _, red_args = _program_key(cfg, "reduce")
        red = _get("reduce", target, *red_args)
        ncr, block = red_args[1], red_args[3]  # contribution rows per slot, values per exponent byte
        cdt = getattr(torch, _contrib_dtype(cfg))
        per_row = ncr * Kp * (Dqk * cdt.itemsize + (Dqk // block if cdt == torch.int16 else 0))  # with the exponents
        chunk = chunk_rows(T_, per_row, _DET_BUDGET_BYTES)
        contrib = torch.empty(chunk * ncr * Kp, Dqk, device=dev, dtype=cdt)
        # contrib_i16: each contribution row's exponent byte per block of values (the ws program's Scales)
        scales = (torch.empty(chunk * ncr * Kp, Dqk // block, device=dev, dtype=torch.uint8)
                  if cdt == torch.int16 else zeros_arg(1, torch.uint8, dev))
        for t0 in range(0, T_, chunk):
            t1 = min(T_, t0 + chunk)
            tc = t1 - t0
            cb = contrib[: tc * ncr * Kp]
            sb = scales[: tc * ncr * Kp] if cdt == torch.int16 else scales
            # probs[:, t0:t1] is not contiguous with two head blocks or more: a chunk buffer of its own
            view = part = None if probs is None else probs[:, t0:t1]
            if view is not None and not view.is_contiguous():
                part = (torch.zeros if skip else torch.empty)(nhb, tc, Kp, device=dev, dtype=torch.float32)
            # the slots' fixed order depends on the indices only: sorted on a side stream while the main program runs
            order_ready = slot_order_async(idx[t0:t1], N, Kp, ncr)
            try:
                if kind == "ws":  # "contrib_ws" / "_bf16" / "_i16": the same contribution rows, from the ws program
                    sums, fix = _no_fixed_point(dev)
                    chunk_fused = (fused[0][t0:t1], fused[1][t0:t1], fused[2]) if fuse else fused
                    main(q2[t0:t1], kv2, do2[t0:t1], idx[t0:t1], lse2[t0:t1], delta[t0:t1], dq[t0:t1], cb, s,
                         s * _LOG2E, _probs_arg(part, dev), sums, sb if cdt == torch.int16 else fix, *chunk_fused)
                else:
                    main(q2[t0:t1], kv2, do2[t0:t1], idx[t0:t1], lse2[t0:t1], delta[t0:t1], dq[t0:t1],
                         cb.view(tc, nhb, Kp, Dqk), s, s * _LOG2E, _probs_arg(part, dev),
                         blocks[t0:t1] if skip else blocks)
                if part is not view:
                    view.copy_(part)
            finally:
                rows, rowptr = order_ready()  # the side stream joins even when a launch raised
            red(cb, sb, rows, rowptr, dkv, Kp)

    dsink = None
    if sink is not None:
        # d_sink_h = -sum_t Delta[t,h] * exp(z_h - lse'[t,h]); lse' = +inf rows give 0
        p_sink = torch.exp2(sink.view(1, H) * _LOG2E - lse2)
        dsink = -(delta * p_sink).sum(0)
    res = (dq.view(B, S, H, Dqk), dkv.view(B, Skv, Dqk), dsink) + ((probs,) if return_probs else ())
    return res, left_permuted
