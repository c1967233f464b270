"""CPU test: every shipped indexer / radix top-k configuration lowers and compiles for sm_90a.

Needs TileLang and nvcc (no GPU). Also checks the pure-Python chunk planner.
"""

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from dsa_plugins.kernels import indexer as K
from dsa_plugins.kernels import topk as TK
from tests.helpers import assert_waits_for_previous_grid

SM90 = {"kind": "cuda", "arch": "sm_90a"}


def _need_toolchain():
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")


#: the (block_q, block_k) tilings of the shipped score programs: each has a plan program
RANGE_TILINGS = sorted({(c["block_q"], c["block_k"]) for c in K.SHIPPED_CONFIGS})


@pytest.fixture(scope="module")
def compiled():
    """Every shipped program, compiled for sm_90a with one worker per CPU (nvcc runs in
    subprocesses); an entry holds the exception if that configuration failed."""
    _need_toolchain()
    jobs = [("indexer", i, c) for i, c in enumerate(K.SHIPPED_CONFIGS)]
    jobs += [("topk", i, c) for i, c in enumerate(TK.SHIPPED_CONFIGS)]
    jobs += [("finish", 0, None)]
    jobs += [("ranges", i, c) for i, c in enumerate(RANGE_TILINGS)]
    jobs += [(f"grads_{side}", i, c) for side in ("query", "key") for i, c in enumerate(K.GRAD_CONFIGS)]

    def build(job):
        kind, _, cfg = job
        try:
            if kind == "ranges":
                return K.build_block_ranges(*cfg, target=SM90).get_kernel_source()
            if kind == "finish":
                return TK.build_finish(target=SM90).get_kernel_source()
            if kind.startswith("grads_"):
                return K.build_score_grads(kind[len("grads_"):], cfg, target=SM90).get_kernel_source()
            fn = K.build_indexer if kind == "indexer" else TK.build_topk
            return fn(cfg, target=SM90).get_kernel_source()
        except Exception as exc:  # reported by the test of that configuration
            return exc

    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as ex:
        return {(kind, i): src for (kind, i, _), src in zip(jobs, ex.map(build, jobs))}


def _src(compiled, key):
    src = compiled[key]
    if isinstance(src, Exception):
        raise src
    return src


@pytest.mark.slow
@pytest.mark.parametrize(
    "i", range(len(K.SHIPPED_CONFIGS)),
    ids=[f"h{c['heads']}d{c['dim']}q{c['block_q']}k{c['block_k']}{'fp8' if c.get('fp8') else ''}"
         f"{'pp' if c.get('pingpong') else ''}" for c in K.SHIPPED_CONFIGS],
)
def test_indexer_configs_compile(compiled, i):
    src = _src(compiled, ("indexer", i))
    assert "wgmma" in src  # the score GEMM runs on Hopper tensor cores
    if K.SHIPPED_CONFIGS[i].get("pingpong"):
        # specialised by hand: a producer at 24 registers, consumers at 240 handing each other the turn to
        # issue their MMAs (named barriers 10 and 11), each storing its own tiles by TMA
        assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
        assert src.count("__named_barrier_arrive(10, 256)") >= 2 and src.count("tma_store(Scores_desc") == 4
    # the relu as one max.NaN (relu_max, the default): a NaN score stays NaN without a compare and a select
    assert "dsa_relu_keep_nan(" in src and "max.NaN.f32" in src
    if K.SHIPPED_CONFIGS[i].get("fp8"):
        assert "kFloat8_e4m3" in src and "KScale" in src


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(RANGE_TILINGS)), ids=[f"q{q}k{k}" for q, k in RANGE_TILINGS])
def test_block_ranges_programs_compile(compiled, i):
    assert "__global__" in _src(compiled, ("ranges", i))


@pytest.mark.slow
@pytest.mark.parametrize(
    "i", range(len(TK.SHIPPED_CONFIGS)),
    ids=[f"t{c['threads']}c{c['cap']}{'a' if c.get('agg') else ''}{'-lse' if c.get('lse') else ''}"
         f"{'-p%d' % c['parts'] if c.get('parts') else ''}" for c in TK.SHIPPED_CONFIGS],
)
def test_topk_configs_compile(compiled, i):
    src = _src(compiled, ("topk", i))
    assert "__global__" in src
    assert ("Lse[" in src) == bool(TK.SHIPPED_CONFIGS[i].get("lse"))  # the lse variants write it
    # the split program: histograms summed and slots taken through the cluster's shared memory
    split = bool(TK.SHIPPED_CONFIGS[i].get("parts"))
    assert ("dsa_peer_i32(" in src and "dsa_peer_add_i32(" in src and "dsa_cluster_sync();" in src) == split
    if split:  # a cluster launch may overlap the score program that writes its rows
        assert_waits_for_previous_grid(src)
    # the ordering bitmap: nibbles OR-ed over 8 lanes, red.shared ORs (TileLang's AtomicOr is
    # red.global), the compaction's popcounts and bit scans
    assert "__shfl_xor_sync" in src and "dsa_shared_or(" in src and "AtomicOr(" not in src and "__ffs(" in src
    cfg = TK.SHIPPED_CONFIGS[i]
    if not split:  # the register cap: the CTAs per SM the configuration asks for (TileLang once folded it to 1)
        blocks = cfg.get("min_blocks") or max(1, 65536 // (cfg["threads"] * 64))
        assert f"__launch_bounds__({cfg['threads']}, {blocks})" in src
    if cfg.get("lse"):  # the last pass's scores summed from their own bitmap, in column order
        assert "cbits" in src
        # every bit loop takes its trip count from the shared word, never from the register it clears bit by bit
        assert re.search(r"__popc\(\(\(uint\*\)cbits\)", src) and not re.search(r"< \(\(int\)__popc\(wv", src)
        # two bitmap walks: the row within the bitmap, and a row past it one window at a time (no re-read of the row)
        assert len(re.findall(r"__popc\(\(\(uint\*\)cbits\)", src)) == 2


def test_split_topk_configuration_rules():
    assert TK.config_for_rows(1, 131072) == TK.SPLIT_CONFIG == TK.config_for_rows(8, 65536)
    assert TK.config_for_rows(TK.SPLIT_MAX_ROWS, 131072) == TK.SPLIT4_CONFIG
    assert TK.config_for_rows(1, 32768 + 4) == TK.SPLIT4_CONFIG == TK.config_for_rows(8, 65535)
    assert TK.config_for_rows(1, 32768) == TK.SPLIT2_CONFIG == TK.config_for_rows(8, 32768)
    assert TK.config_for_rows(1, 131072, lse=True) == TK.DEFAULT_CONFIG  # the split program writes no lse
    assert TK.config_for_rows(TK.SPLIT_MAX_ROWS + 1, 131072) == TK.SPLIT2_CONFIG == TK.config_for_rows(64, 65536)
    # two parts from 32K columns: a generation step of 9-64 rows over 32K caches (the batched layout's buffer is
    # one key block wider than the cache)
    assert TK.config_for_rows(9, 32768) == TK.SPLIT2_CONFIG == TK.config_for_rows(64, 32768 + 64)
    assert TK.config_for_rows(TK.SPLIT2_MAX_ROWS + 1, 131072) == TK.DEFAULT_CONFIG == TK.config_for_rows(32, 32767)
    assert TK.config_for_rows(32, 131072, lse=True) == TK.DEFAULT_CONFIG
    assert TK.config_for_rows(1, 32767) == TK.DEFAULT_CONFIG
    with pytest.raises(ValueError, match="writes no lse"):
        TK._config_key({**TK.SPLIT_CONFIG, "lse": True})
    with pytest.raises(ValueError, match="parts must be"):
        TK._config_key({**TK.SPLIT_CONFIG, "parts": 3})
    with pytest.raises(ValueError, match="min_blocks does not apply"):
        TK._config_key({**TK.SPLIT_CONFIG, "min_blocks": 2})


@pytest.mark.slow
@pytest.mark.parametrize("side", ["query", "key"])
@pytest.mark.parametrize("i", range(len(K.GRAD_CONFIGS)),
                         ids=[f"h{c['heads']}d{c['dim']}q{c['block_q']}k{c['block_k']}" for c in K.GRAD_CONFIGS])
def test_score_gradient_programs_compile(compiled, side, i):
    src = _src(compiled, (f"grads_{side}", i))
    assert src.count("wgmma_ss") >= 2  # S and the gradient GEMM on Hopper tensor cores
    assert "atomic" not in src.lower()  # reproducible sums: no atomics


def test_gradient_tiling_follows_the_score_buffers():
    for cfg in K.TILED_CONFIGS:  # the tilings the dense warm-up loss scores with
        if cfg.get("fp8"):
            continue
        g = K.grad_config(cfg)
        assert g in K.GRAD_CONFIGS
        assert g["block_k"] == cfg["block_k"] and cfg["block_q"] % g["block_q"] == 0
        assert g["block_q"] * g["heads"] <= 128 or g["block_q"] == 1
    with pytest.raises(ValueError, match="side"):
        K.build_score_grads("both", K.GRAD_CONFIGS[0])


@pytest.mark.slow
def test_topk_finish_program_compiles(compiled):
    src = _src(compiled, ("finish", 0))
    assert "__global__" in src and "__shfl_up_sync" in src  # the column-ordered scans (ties, order)
    assert "dsa_shared_or(" in src and "__ffs" in src and "__popc" in src  # the ordering bitmap and its compaction
    assert "AtomicOr(" not in src  # TileLang's atomic_or is red.global: it faults on the shared bitmap


def test_supported_shapes_and_configs():
    assert callable(K.indexer_topk) and callable(TK.topk_rows)
    assert K.unsupported_reason(64, 128, 2048) is None
    assert K.unsupported_reason(32, 128, 4096) is None
    assert K.unsupported_reason(12, 128, 2048) is not None
    assert K.unsupported_reason(64, 128, 2048, torch.float8_e4m3fn) is None
    assert "multiple of 32" in K.unsupported_reason(64, 48, 2048, torch.float8_e4m3fn)
    assert "float8_e4m3fn" in K.unsupported_reason(64, 128, 2048, torch.float16)
    for cfg in K.PREFILL_CONFIGS:
        assert K.default_config(cfg["heads"], cfg["dim"], cfg.get("fp8", False)) == cfg
        assert K.default_config(cfg["heads"], cfg["dim"], cfg.get("fp8", False), rows=4096) == cfg
    for cfg in K.DECODE_CONFIGS:  # generation steps: one query row per CTA
        assert cfg["block_q"] == 1
        assert K.default_config(cfg["heads"], cfg["dim"], cfg.get("fp8", False), rows=K.DECODE_MAX_ROWS) == cfg
    # every tiled configuration ships too (the dense loss scores with them; generation steps derive from them)
    assert all(c in K.SHIPPED_CONFIGS for c in K.TILED_CONFIGS + K.PREFILL_CONFIGS + K.DECODE_CONFIGS)
    assert len(K.SHIPPED_CONFIGS) == len(K.TILED_CONFIGS) + 4 + len(K.DECODE_CONFIGS)  # + 4 hand-specialised
    for cfg in K.TILED_CONFIGS:
        assert K.default_config(cfg["heads"], cfg["dim"], cfg.get("fp8", False), tiled=True) == cfg
        assert not cfg.get("pingpong")
    # 32 and 64 index heads of 128 score their prefill on the hand-specialised program: 64-key blocks of 256
    # columns (the m64n256 MMA of one consumer)
    assert [c.get("pingpong", False) for c in K.PREFILL_CONFIGS] == [
        c["heads"] in (32, 64) and c["dim"] == 128 for c in K.PREFILL_CONFIGS]
    assert all(c["block_k"] == 64 and c["block_q"] * c["heads"] == 256 for c in K.PREFILL_CONFIGS if c.get("pingpong"))
    with pytest.raises(ValueError, match="pingpong"):
        K.build_indexer({**K.PREFILL_CONFIGS[0], "relu_max": False}, target=SM90)
    assert TK.config_for_rows(65, 32768) == TK.DEFAULT_CONFIG == TK.config_for_rows(64, 32767)
    assert TK.config_for_rows(8192, 8192) == TK.MANY_SHORT_ROWS_CONFIG
    assert TK.config_for_rows(4096, 65536) == TK.MANY_LONG_ROWS_CONFIG
    for cfg in (TK.DEFAULT_CONFIG, TK.MANY_SHORT_ROWS_CONFIG, TK.MANY_LONG_ROWS_CONFIG):
        assert cfg in TK.SHIPPED_CONFIGS


def test_plan_chunks_budget_and_cover():
    """Each chunk's buffer fits the budget (or holds one block) and is as wide as its widest block
    (a row's columns start at its own block's first key block)."""
    rng = np.random.default_rng(0)
    nqb = 500
    lo = rng.integers(0, 50, nqb).astype(np.int32)
    hi = (lo + rng.integers(0, 60, nqb)).astype(np.int32)
    hi[::7] = lo[::7]  # empty blocks
    bq, bk, budget = 2, 64, 2 * 64 * 4 * 40 * 5
    chunks = K._plan_chunks(lo, hi, bq, bk, budget)
    assert chunks[0][0] == 0 and chunks[-1][1] == nqb
    for (a, b, wb), nxt in zip(chunks, chunks[1:] + [None]):
        if nxt is not None:
            assert nxt[0] == b
        assert (b - a) * bq * wb * bk * 4 <= budget or b - a == 1
        assert wb == max(0, int((hi[a:b].astype(np.int64) - lo[a:b]).max()))


@pytest.mark.slow
def test_indexer_relu_as_compare_and_select_compiles():
    """relu_max=False (the compare and select the max.NaN replaced) still compiles, without the prelude's max."""
    _need_toolchain()
    src = K.build_indexer({**K.TILED_CONFIGS[0], "relu_max": False}, target=SM90).get_kernel_source()
    assert "wgmma" in src and "dsa_relu_keep_nan" not in src


def test_key_range_splits_rule(monkeypatch):
    """Generation steps (one row per CTA) take one wave of at most two CTAs per SM (rounded down); blocks of
    several rows about four per SM (rounded up); never more parts than key blocks, never fewer than one."""
    monkeypatch.setattr(K, "_sm_count", lambda device: 132)
    rows = lambda b, width=1025: K._splits(b, width, None, one_row_blocks=True)  # noqa: E731
    assert [rows(b) for b in (1, 8, 32, 64, 132, 264, 1000)] == [264, 33, 8, 4, 2, 1, 1]
    assert all(rows(b) * b <= 2 * 132 for b in range(1, 265))
    assert rows(1, width=16) == 16 and rows(1, width=1) == 1
    assert [K._splits(b, 1025, None) for b in (8, 32, 528, 600)] == [66, 17, 1, 1]
