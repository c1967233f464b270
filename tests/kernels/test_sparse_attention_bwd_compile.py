"""CPU checks of the sparse attention backward: every shipped configuration compiles for sm_90a
(atomic and deterministic main programs, deterministic reduce, the preprocess that the main programs now fold
in), plus the pure-Python parts of the wrapper."""

import importlib.util
import logging
import re

import pytest
import torch

from dsa_plugins.kernels import contrib_reduce
from dsa_plugins.kernels import sparse_attention_bwd as bwd
from tests.helpers import assert_waits_for_previous_grid

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
SM90A = {"kind": "cuda", "arch": "sm_90a"}


def test_module_imports_without_tilelang_side_effects():
    # the module itself must not import tilelang at import time
    with open(bwd.__file__) as f:
        src = f.read()
    top = src.split("def ", 1)[0]
    assert "import tilelang" not in top


def test_shipped_configs_cover_the_required_shapes():
    got = {(c["heads"], c["dqk"], c["dv"], c["has_sink"]) for c in bwd.SHIPPED_CONFIGS}
    for need in [(64, 512, 512, True), (128, 512, 512, True), (64, 576, 512, False), (128, 576, 512, False)]:
        assert need in got
    heads = {c["heads"] for c in bwd.SHIPPED_CONFIGS}
    assert {16, 32} <= heads


def test_prepare_indices_pads_and_globalises():
    idx = torch.tensor([[[0, 5, -1, 7]], [[3, -2, 4, 2]]], dtype=torch.int32)  # B=2, S=1, K=4, Skv=5
    g = bwd._prepare_indices(idx, skv=5, block_k=32)
    assert g.shape == (2, 32) and g.dtype == torch.int32
    assert g[0, :4].tolist() == [0, -1, -1, -1]  # 5 and 7 are out of range
    assert g[1, :4].tolist() == [8, -1, 9, 7]  # + b * Skv
    assert (g[:, 4:] == -1).all()


def test_normalise_config_defaults_and_errors():
    cfg = bwd._normalise_config({"heads": 16, "dqk": 576, "dv": 512})
    assert cfg["block_k"] >= 16 and cfg["dv"] % cfg["dkv_chunk"] == 0 and cfg["dtype"] == "bfloat16"
    with pytest.raises(ValueError):
        bwd._normalise_config({"heads": 16, "dqk": 64, "dv": 128})
    with pytest.raises(ValueError):
        bwd._normalise_config({"heads": 16, "dqk": 64, "dv": 64, "dtype": "float32"})


def test_bwd_flops_convention():
    # V3.2-like shape: 2 * H * k * (2 * Dv + 3 * Dqk) per query
    assert bwd.bwd_flops(1, 128, 2048, 576, 512) == 2 * 128 * 2048 * (2 * 512 + 3 * 576)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("config", bwd.SHIPPED_CONFIGS,
                         ids=lambda c: f"H{c['heads']}-D{c['dqk']}-{c['dv']}-{'sink' if c['has_sink'] else 'nosink'}")
def test_shipped_config_compiles_for_sm90a(config, caplog):
    with caplog.at_level(logging.INFO, logger="dsa_plugins"):
        progs = bwd.build_bwd_kernels(config, target=SM90A)
    # every shipped shape runs the ws program in both modes: the deterministic one (default "contrib_i16")
    # stores int16 contribution rows, then the reduce sums them
    # the ws programs form lse' and Delta themselves (ws_fused_pre): no preprocess launch; it still compiles
    assert set(progs) == {"main", "main_det", "main_probs", "main_det_probs", "reduce"}
    assert "Maxima[" not in bwd.build_bwd_program(config, "preprocess", target=SM90A).get_kernel_source()
    for name in ("main", "main_det", "main_probs", "main_det_probs"):
        fused = progs[name].get_kernel_source()
        # warpgroup 1 writes Delta and lse' and hands Delta to warpgroup 0 over its own barrier
        assert "Delta[" in fused and "Lse2[" in fused and "__named_barrier_arrive(11, 256)" in fused, name
    # dkv's columns permuted within groups of 16 (ws_dkv_perm): one register exchange per reduction
    red = "dsa_red_tile<0, 4, false, true>("
    probs_src = progs["main_probs"].get_kernel_source()
    assert red in probs_src and "Probs[" in probs_src  # the ws program with the head-summed P
    src = progs["main"].get_kernel_source()
    assert "wgmma" in src  # Hopper tensor-core path
    # the warp-specialised program: two warpgroups handing P / dS over named barriers, dkv sent as
    # full-line v4 reductions from the accumulators
    assert red in src and "__named_barrier_arrive" in src and "AtomicAdd" not in src
    # P = 2^x as one ex2.approx.ftz (fast_exp2); each reduction predicated inside its asm, no branch around it
    assert "dsa_ex2_ftz(" in src and "exp2f(" not in src and "@q red.global.add.v4.f32" in src
    d512 = config["dqk"] == config["dv"]
    pair = d512 and (config["heads"] + 63) // 64 % 2 == 0
    # q and dout by TMA (ws_tma_q)
    for name in ("main", "main_det"):
        assert "tl::tma_load" in progs[name].get_kernel_source(), name
    for name in ("main_det", "main_det_probs"):
        # deterministic: each slot's contribution stored as int16 rows (mode 5), no reduction of any kind; at
        # D512 each store predicated inside its asm (det_store_pred), and with an even number of head blocks
        # one row per slot of a pair, summed in a cluster (det_pair), each CTA storing its half of every chunk in
        # the permuted column order (det_pair_perm); else the whole tile, columns permuted (ws_dkv_perm)
        det = progs[name].get_kernel_source()
        body = det.split("dsa_bwd_ws_kernel(", 1)[1]
        assert "wgmma" in det and "AtomicAdd" not in det
        assert "dsa_red_tile<0" not in body and "dsa_red_tile<2>(" not in body
        if pair:
            assert "dsa_pair_finish<5, true, true>(" in body and "dsa_pair_send(" in body
            assert "dsa_red_tile<5" not in body
            assert_waits_for_previous_grid(det)  # a cluster launch may overlap the forward that wrote O and lse
        else:
            assert f"dsa_red_tile<5, 4, {str(d512).lower()}, true>(" in body
            assert "dsa_pair_send(" not in body
    for name in ("main", "main_det", "main_probs", "main_det_probs"):
        # one grid dimension, head blocks fastest (a query row's CTAs reduce into the same dkv rows together):
        # no blockIdx.y, whose 65535 would cap the query rows
        main_src = progs[name].get_kernel_source()
        assert "blockIdx.x" in main_src and "blockIdx.y" not in main_src, name
        if config["heads"] > 64:  # two head blocks: the row is blockIdx.x / 2
            assert re.search(r"blockIdx\.x\)+ >> (\(int64_t\))?1\)", main_src), name
    # a second build is served from the in-process cache: no new compile log line
    n = len([r for r in caplog.records if "compiled" in r.getMessage()])
    with caplog.at_level(logging.INFO, logger="dsa_plugins"):
        bwd.build_bwd_kernels(config, target=SM90A)
    assert len([r for r in caplog.records if "compiled" in r.getMessage()]) == n


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_skip_tail_variant_compiles_and_reads_row_blocks():
    """The tuning variant that stops each row after its last valid slot (not shipped yet)."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "skip_tail": True,
           "schedule": "plain"}
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()
    assert "RowBlocks[" in src and "wgmma" in src


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_ws_program_finds_each_rows_last_valid_block_itself():
    """skip_tail is the ws program's default: each CTA scans its row's slots for the last valid one (no
    RowBlocks input, no launch before it) and walks its blocks up to it; skip_tail False walks all of them."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"}
    assert bwd._normalise_config(cfg)["skip_tail"] and not bwd._normalise_config({**cfg, "schedule": "plain"})["skip_tail"]
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source().split("dsa_bwd_ws_kernel(", 1)[1]
    assert "dsa_row_last_scan<256>(" in src and "RowBlocks" not in src and "kb < n_blocks" in src
    full = bwd.build_bwd_program({**cfg, "skip_tail": False}, "main", target=SM90A).get_kernel_source()
    assert "dsa_row_last_scan<256>(" not in full.split("dsa_bwd_ws_kernel(", 1)[1]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_l2_keep_variant_sends_staged_reductions_with_a_cache_policy():
    """The staged v4 reductions with an L2 evict_last policy (an experiment, not shipped): the
    PTX assembles for sm_90a and replaces every atomic."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "stage_atomics": True,
           "l2_keep": True, "schedule": "plain"}
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()
    assert "L2::cache_hint" in src and "dsa_red_v4_keep(" in src and "AtomicAdd" not in src
    assert not bwd._normalise_config({**cfg, "stage_atomics": False})["l2_keep"]  # only with staging


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_ws_pair_variant_exchanges_halves_in_a_cluster():
    """``ws_pair`` (an experiment, off: measured slower, see _ws_body): the V4 H128 program sends each chunk's
    other half to its peer and reduces its own, pipelined by one chunk (the last one after the loop), between
    two cluster barriers; the atomic mode with an even head-block count and dqk == dv only."""
    cfg = {"heads": 128, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16", "ws_pair": True}
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()
    body = src.split("dsa_bwd_ws_kernel(", 1)[1]
    assert body.count("dsa_pair_send(") == 8 and body.count("dsa_pair_finish<0>(") == 9
    assert body.count("dsa_cluster_sync();") == 2 and "dsa_red_tile<0" not in body
    assert_waits_for_previous_grid(src)
    for other in ({"heads": 64}, {"heads": 128, "dqk": 576}, {"heads": 192}):
        assert not bwd._normalise_config({**cfg, **other})["ws_pair"], other
    det = bwd.build_bwd_program({**cfg, "det_pair": False}, "main_det", target=SM90A).get_kernel_source()
    assert "dsa_pair_send(" not in det.split("dsa_bwd_ws_kernel(", 1)[1]


def test_det_pair_defaults_and_its_reduce():
    """``det_pair`` (one contribution row per slot of a head-block pair): on where ws_pair can run (an even number of
    head blocks, dqk == dv, the ws schedule) and off elsewhere; its reduce sums ncr = NHB / 2 rows per slot, by
    default (det_pair_perm) in the unpaired rows' permuted layout with int16 blocks of 8 values; without it in the real
    column order with int16 blocks of 4 (the other dtypes have no exponent bytes: the same program as unpaired)."""
    v4 = {"heads": 128, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16"}
    assert bwd._normalise_config(v4)["det_pair"] and bwd._normalise_config({**v4, "heads": 256})["det_pair"]
    for other in ({"heads": 64}, {"heads": 192}, {"dqk": 576}, {"schedule": "plain"}, {"det_pair": False}):
        assert not bwd._normalise_config({**v4, **other})["det_pair"], other
    key = bwd._program_key
    assert key(bwd._normalise_config(v4), "reduce") == ("reduce", (512, 1, "int16", 8, True))
    assert key(bwd._normalise_config({**v4, "heads": 256}), "reduce") == ("reduce", (512, 2, "int16", 8, True))
    real = {**v4, "det_pair_perm": False}
    assert key(bwd._normalise_config(real), "reduce") == ("reduce", (512, 1, "int16", 4))
    assert key(bwd._normalise_config({**real, "heads": 256}), "reduce") == ("reduce", (512, 2, "int16", 4))
    assert key(bwd._normalise_config({**real, "det_mode": "contrib_bf16"}), "reduce") == ("reduce", (512, 1, "bfloat16", 8))
    # unpaired rows come with their columns permuted (ws_dkv_perm): the reduce's key says so
    assert key(bwd._normalise_config({**v4, "det_pair": False}), "reduce") == ("reduce", (512, 2, "int16", 8, True))
    assert key(bwd._normalise_config({**v4, "heads": 64}), "reduce") == ("reduce", (512, 1, "int16", 8, True))
    mla = bwd._normalise_config({**v4, "dqk": 576})
    assert key(mla, "reduce") == ("reduce", (576, 2, "int16", 8, True)) and mla["ws_tma_q"] and not mla["det_store_pred"]
    assert key(bwd._normalise_config({**v4, "dqk": 576, "ws_dkv_perm": False}), "reduce") == ("reduce", (576, 2, "int16", 8))
    plain = bwd._normalise_config({**v4, "schedule": "plain"})
    assert not plain["ws_tma_q"] and not plain["det_store_pred"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_pair_reduce_reads_one_exponent_byte_per_4_columns():
    """The det_pair reduce in the real column order (det_pair_perm off; int16 blocks of 4 values): a lane's 4 columns
    r * 128 + 4 lane .. + 3 take byte r * 32 + lane of its row's dqk / 4 = 128 bytes."""
    red = bwd.build_bwd_program({"heads": 128, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16",
                                 "det_pair_perm": False}, "reduce", target=SM90A).get_kernel_source()
    assert "Exps[(((((int64_t)base) * (int64_t)128) + (((int64_t)r_1) * (int64_t)32)) + " \
           "(((int64_t)((int)threadIdx.x)) & (int64_t)31))]" in red


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_ws_wg0_chunks_move_the_last_dkv_chunks_to_warpgroup_0():
    """``ws_wg0_chunks`` (default 2; 3 here): warpgroup 0 reduces the last chunks from
    its S and dP accumulators (the K-only tail among them), warpgroup 1 the others from its two chunk buffers."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "ws_dkv_perm": False}
    assert bwd._normalise_config(cfg)["ws_wg0_chunks"] == 2
    assert bwd._normalise_config({**cfg, "dqk": 512, "heads": 128})["ws_wg0_chunks"] == 2
    assert bwd._normalise_config({**cfg, "dqk": 512, "heads": 128, "ws_pair": True})["ws_wg0_chunks"] == 0
    assert bwd._normalise_config({**cfg, "dqk": 128, "dv": 128})["ws_wg0_chunks"] == 1  # never all of them
    with pytest.raises(ValueError, match="ws_wg0_chunks must be 0..3"):
        bwd._normalise_config({**cfg, "ws_wg0_chunks": 4})
    cfg["ws_wg0_chunks"] = 3
    body = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source().split("dsa_bwd_ws_kernel(", 1)[1]
    assert body.count("dsa_red_tile<0>(acc_s,") == 2 and body.count("dsa_red_tile<0>(acc_dp,") == 1
    assert body.count("dsa_red_tile<0>(") == 9  # 9 chunks of 64 columns, each reduced once
    assert ", 576, 512, " in body.split("dsa_red_tile<0>(acc_s,")[2]  # the tail, last in warpgroup 0


def test_schedule_defaults_to_ws_where_its_shapes_allow():
    assert bwd._normalise_config({"heads": 64, "dqk": 576, "dv": 512})["schedule"] == "ws"
    assert bwd._normalise_config({"heads": 128, "dqk": 512, "dv": 512})["schedule"] == "ws"
    assert bwd._normalise_config({"heads": 16, "dqk": 96, "dv": 64})["schedule"] == "plain"
    with pytest.raises(ValueError, match="schedule 'ws' needs"):
        bwd._normalise_config({"heads": 16, "dqk": 96, "dv": 64, "schedule": "ws"})
    # the ws program walks 64-slot blocks: another block_k takes the plain program, or is refused for ws
    assert bwd._normalise_config({"heads": 64, "dqk": 576, "dv": 512, "block_k": 32})["schedule"] == "plain"
    with pytest.raises(ValueError, match="block_k 64"):
        bwd._normalise_config({"heads": 64, "dqk": 576, "dv": 512, "block_k": 32, "schedule": "ws"})
    with pytest.raises(ValueError, match="schedule must be one of"):
        bwd._normalise_config({"heads": 16, "dqk": 576, "dv": 512, "schedule": "fast"})
    cfg = bwd._normalise_config({"heads": 64, "dqk": 576, "dv": 512})
    # the ws program serves both modes (with or without the head-summed probabilities): deterministic
    # (default det_mode "contrib_i16", or "fixed"); det_mode "contrib" (and the plain schedule) runs the
    # plain program
    assert bwd._main_kernel(cfg, False)[0] == "ws"
    assert bwd._main_kernel(cfg, False, emit_probs=True)[0] == "ws"
    import inspect

    det_at = list(inspect.signature(bwd._ws_body).parameters).index("det_out")  # the ws program's args in order
    assert cfg["det_mode"] == "contrib_i16" and bwd._main_kernel(cfg, True)[1][det_at] == "contrib_i16"
    assert bwd._main_kernel({**cfg, "det_mode": "contrib"}, True)[0] == "main"
    kind, args = bwd._main_kernel({**cfg, "det_mode": "fixed"}, True)
    assert kind == "ws" and args[det_at] == "fixed"  # the ws program's deterministic output
    assert bwd._main_kernel({**cfg, "det_mode": "contrib_ws"}, True)[1][det_at] == "contrib"
    assert bwd._main_kernel(cfg, False)[1][det_at] is None
    assert bwd._main_kernel({**cfg, "det_mode": "contrib_ws"}, False) == bwd._main_kernel(cfg, False)
    assert bwd._main_kernel({**cfg, "schedule": "plain"}, False)[0] == "main"
    plain = bwd._normalise_config({"heads": 16, "dqk": 96, "dv": 64})
    assert plain["det_mode"] == "contrib" and bwd.bwd_program_names(plain)[-1] == "reduce"
    for mode in ("fixed", "contrib_ws"):  # modes of the ws program
        with pytest.raises(ValueError, match="det_mode"):
            bwd._normalise_config({"heads": 16, "dqk": 96, "dv": 64, "det_mode": mode})
    with pytest.raises(ValueError, match="det_mode"):
        bwd._normalise_config({"heads": 16, "dqk": 576, "dv": 512, "det_mode": "exact"})


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_ws_dkv_perm_variant_sends_one_exchange_reductions():
    """ws_dkv_perm (the default): the ws program's reductions, and its deterministic contribution rows, with dkv's
    columns permuted (kPermCols), the reduce reading them so; the pairs, "fixed" and the plain schedule never take
    it."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"}
    assert bwd._normalise_config(cfg)["ws_dkv_perm"]
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()
    assert "dsa_red_tile<0, 4, false, true>(" in src and "dsa_red_tile<0>(" not in src
    det = bwd.build_bwd_program(cfg, "main_det", target=SM90A).get_kernel_source()
    assert "dsa_red_tile<5, 4, false, true>(" in det
    norm = bwd._normalise_config(cfg)
    assert bwd._program_key(norm, "reduce") == ("reduce", (576, 1, "int16", 8, True))
    bwd.build_bwd_program(cfg, "reduce", target=SM90A)  # compiles
    pair = bwd._normalise_config({**cfg, "heads": 128, "dqk": 512, "ws_pair": True})
    assert not bwd._main_kernel(pair, False)[1][bwd._WS_PERM_AT]
    # det_pair: by default (det_pair_perm) the pair's rows permuted as well; without it in the real column order
    det_pair = bwd._normalise_config({**cfg, "heads": 128, "dqk": 512})
    assert bwd._main_kernel(det_pair, True)[1][bwd._WS_PERM_AT]
    assert bwd._program_key(det_pair, "reduce")[1][-1] is True
    det_pair_real = bwd._normalise_config({**cfg, "heads": 128, "dqk": 512, "det_pair_perm": False})
    assert not bwd._main_kernel(det_pair_real, True)[1][bwd._WS_PERM_AT]
    assert len(bwd._program_key(det_pair_real, "reduce")[1]) == 4
    assert not bwd._main_kernel({**norm, "det_mode": "fixed"}, True)[1][bwd._WS_PERM_AT]
    assert not bwd._normalise_config({**cfg, "schedule": "plain"})["ws_dkv_perm"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_ws_tma_dq_variant_stores_dq_by_tma():
    """ws_tma_dq (opt-in, with ws_stage_dq): each warpgroup's staged dq tiles leave by TMA stores (576/512: the
    K-only tail too); off by default, and off without the staging."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16"}
    assert not bwd._normalise_config(cfg)["ws_tma_dq"]
    assert not bwd._normalise_config({**cfg, "ws_tma_dq": True, "ws_stage_dq": False})["ws_tma_dq"]
    src = bwd.build_bwd_program({**cfg, "ws_tma_dq": True}, "main", target=SM90A).get_kernel_source()
    assert src.count("tl::tma_store(dQ_desc") == 3 and "tl::tma_store_wait" in src
    assert "tma_store(dQ_desc" not in bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()


def test_ws_row_regs_defaults_by_shape():
    """ws_row_regs: 2 at D512, 1 at 576/512 (2 spills there), 0 off the ws schedule; other values refused."""
    base = {"heads": 64, "dv": 512, "dtype": "bfloat16"}
    assert bwd._normalise_config({**base, "dqk": 512})["ws_row_regs"] == 2
    assert bwd._normalise_config({**base, "dqk": 576})["ws_row_regs"] == 1
    assert bwd._normalise_config({**base, "dqk": 576, "schedule": "plain"})["ws_row_regs"] == 0
    assert bwd._normalise_config({**base, "dqk": 512, "ws_row_regs": 0})["ws_row_regs"] == 0
    with pytest.raises(ValueError, match="ws_row_regs"):
        bwd._normalise_config({**base, "dqk": 512, "ws_row_regs": 3})


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_ws_row_regs_moves_the_slot_test_into_the_exponent(mode):
    """ws_row_regs 1 and 2: P is 2^x of a selected argument (-inf at invalid slots), not a selected 2^x; 2 also
    forms every slot's argument before the selection (no load of the softmax under the slot test)."""
    cfg = {"heads": 64, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16", "ws_row_regs": mode}
    src = bwd.build_bwd_program(cfg, "main", target=SM90A).get_kernel_source()
    of_selected = re.search(r"acc_s\[i_\d+\] = dsa_ex2_ftz\(condval_\d+\);", src)
    assert bool(of_selected) == (mode > 0)
    # the softmax's read of lse' sits in the selected value (condval) unless every argument is formed first
    lse_reads = [line for line in src.split("\n") if "lse_s)[" in line and "dsa_ex2_ftz" not in line]
    assert any("condval_" in line for line in lse_reads) == (mode == 1)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_fixed_point_deterministic_path_compiles():
    """det_mode "fixed" (the ws program sending fixed-point integer reductions; an option, slower than
    the contributions on an H100): its preprocess also writes the finite maxima of q, out and dout, and
    every chunk's values go out as integer reductions, none as fp32 sums; no reduce program."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "det_mode": "fixed"}
    progs = bwd.build_bwd_kernels(cfg, target=SM90A)
    assert "reduce" not in progs and "Maxima[" in progs["preprocess_det"].get_kernel_source()
    for name in ("main_det", "main_det_probs"):
        det = progs[name].get_kernel_source()
        assert "dsa_red_tile<2>(" in det and "dsa_red_tile<0" not in det and "FixedSums" in det


def _acc_layout(tile, groups=4, rank=0):
    """(acc [128 threads, 32 or 16 registers], first column) of a [64, 64] tile in one warpgroup's m64n64 wgmma
    accumulator: thread t's register i holds row 16 w + lane / 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) + 2 (lane & 3)
    + (i & 1). ``groups`` 2: the half a pair's CTA of rank ``rank`` keeps (registers from 16 rank, columns from 32
    rank)."""
    import numpy as np

    full = np.zeros((128, 32))
    for t in range(128):
        w, lane = t >> 5, t & 31
        for i in range(32):
            full[t, i] = tile[16 * w + (lane >> 2) + 8 * ((i >> 1) & 1), 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)]
    return (full[:, 16 * rank:], 32 * rank) if groups == 2 else (full, 0)


def _red_tile_model(tile, groups=4, rank=0, perm=False):
    """What dsa_red_tile<kMode, groups> adds, modelled lane by lane: the m64n64 accumulator layout of one
    warpgroup, the two shuffles (each lane reads what its partner sends), then each lane's (row, column,
    float4) reductions. ``groups`` 2: the half tile rank ``rank`` of a pair sends (dsa_pair_red: the
    accumulator from element 16 rank, columns from 32 rank). ``perm`` (kPermCols): no first exchange, each lane's
    float4 at column 4 q of its 16-column group (dkv's columns permuted). Returns (sum, hit count) per tile element."""
    import numpy as np

    acc, col0 = _acc_layout(tile, groups, rank)
    out, hits = np.zeros((64, 64)), np.zeros((64, 64), dtype=int)
    for half in range(2):
        a = {(t, m): acc[t, 8 * m + 2 * half: 8 * m + 2 * half + 2] for t in range(128) for m in range(groups)}
        b = {(t, m): acc[t, 8 * m + 4 + 2 * half: 8 * m + 6 + 2 * half] for t in range(128) for m in range(groups)}
        send = {(t, m): a[t, m] if t & 1 else b[t, m] for t in range(128) for m in range(groups)}
        v = {(t, m): np.concatenate([send[t ^ 1, m], b[t, m]]) if t & 1 else np.concatenate([a[t, m], send[t ^ 1, m]])
             for t in range(128) for m in range(groups)}
        if perm:
            v = {(t, m): np.concatenate([a[t, m], b[t, m]]) for t in range(128) for m in range(groups)}
        gb = {t: ((t & 31) >> 2) & 1 for t in range(128)}
        send2 = {(t, mp): v[t, 2 * mp] if gb[t] else v[t, 2 * mp + 1] for t in range(128) for mp in range(groups // 2)}
        for t in range(128):
            q, g = t & 3, (t & 31) >> 2
            slot = 16 * (t >> 5) + 8 * half + (g & ~1)
            for mp in range(groups // 2):
                r = send2[t ^ 4, mp]
                va, vb = (r, v[t, 2 * mp + 1]) if gb[t] else (v[t, 2 * mp], r)
                col = col0 + 16 * (2 * mp + gb[t]) + (4 * q if perm else 8 * (q & 1) + 4 * (q >> 1))
                for row, val in ((slot, va), (slot + 1, vb)):
                    out[row, col:col + 4] += val
                    hits[row, col:col + 4] += 1
    return out, hits


def test_red_tile_lane_mapping_covers_the_tile_once():
    import numpy as np

    tile = np.random.default_rng(0).standard_normal((64, 64))
    out, hits = _red_tile_model(tile)
    assert (hits == 1).all()
    assert np.array_equal(out, tile)


def test_red_tile_with_permuted_columns_covers_the_tile_once():
    """kPermCols (ws_dkv_perm): one register exchange; every element reaches its permuted column once, and the
    wrapper's inverse permutation gives the tile back."""
    import numpy as np

    tile = np.random.default_rng(2).standard_normal((64, 64))
    out, hits = _red_tile_model(tile, perm=True)
    assert (hits == 1).all()
    assert np.array_equal(out, bwd._dkv_cols_permuted(torch.from_numpy(tile)).numpy())
    assert np.array_equal(bwd._dkv_cols_permuted(torch.from_numpy(out), inverse=True).numpy(), tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dkv_cols_restored_is_the_inverse_permutation_and_the_cast_in_one(dtype):
    """The wrapper's one-pass restore of a dkv of its own: the same bits as the inverse permutation then the cast,
    contiguous, for batched [B, Skv, D] rows of both widths."""
    for shape in ((2, 5, 576), (1, 3, 512)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))
        got = bwd._dkv_cols_restored(x, dtype)
        assert got.dtype == dtype and got.is_contiguous() and got.shape == x.shape
        assert torch.equal(got, bwd._dkv_cols_permuted(x, inverse=True).to(dtype))
        assert torch.equal(bwd._dkv_cols_permuted(got.float()), x.to(dtype).float())


def test_dkv_dtype_is_checked_before_any_launch():
    """dkv_dtype: only for a dkv of ours (a given one is fp32 and added to), and a floating dtype the kernels cast to."""
    q = torch.zeros(1, 2, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 2, 8, dtype=torch.int32)
    out = torch.zeros(1, 2, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)
    args = (q, kv, idx, out, lse, out.clone(), 0.1)
    with pytest.raises(ValueError, match="dkv_dtype is for a dkv of ours"):
        bwd.sparse_attention_bwd(*args, dv=512, dkv=torch.zeros(1, 4, 576), dkv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dkv_dtype must be float32, bfloat16 or float16, got torch.int32"):
        bwd.sparse_attention_bwd(*args, dv=512, dkv_dtype=torch.int32)


def test_pair_halves_cover_the_tile_once():
    """dsa_pair_red: rank 0 reduces accumulator elements 0..15 at columns 0..31, rank 1 elements 16..31 at
    columns 32..63 (each summed with the peer's same elements); together every element once."""
    import numpy as np

    tile = np.random.default_rng(1).standard_normal((64, 64))
    (o0, h0), (o1, h1) = _red_tile_model(tile, 2, 0), _red_tile_model(tile, 2, 1)
    assert (h0[:, :32] == 1).all() and (h0[:, 32:] == 0).all() and (h1[:, 32:] == 1).all() and (h1[:, :32] == 0).all()
    assert np.array_equal(o0 + o1, tile)


def _contrib_perm_model(tile, groups=4, rank=0):
    """What dsa_red_tile<kMode >= 3, groups, pred, kPermCols> stores in the contribution rows, modelled lane by lane
    (the accumulator layout of ``_red_tile_model``; ``groups`` 2: the half tile of pair rank ``rank``, its
    accumulator from element 16 rank, columns from 32 rank), then sent to real columns by the reduce's map. Returns
    (sum, hit count) per tile element, in real columns."""
    import numpy as np

    acc, col0 = _acc_layout(tile, groups, rank)
    out, hits = np.zeros((64, 64)), np.zeros((64, 64), dtype=int)
    for t in range(128):
        q, g = t & 3, (t & 31) >> 2
        for half in range(2):
            slot = 16 * (t >> 5) + 8 * half + g
            v = [acc[t, [8 * m + 2 * half, 8 * m + 2 * half + 1, 8 * m + 4 + 2 * half, 8 * m + 5 + 2 * half]]
                 for m in range(groups)]
            for p in range(groups // 2):  # dsa_store_row8: v[2 p] then v[2 p + 1] at col0 + 8 q + 32 p
                for j in range(2):
                    for c in range(4):
                        col = col0 + 8 * q + 32 * p + 4 * j + c
                        real = col // 32 * 32 + col % 8 // 4 * 16 + col % 4 // 2 * 8 + col % 32 // 8 * 2 + col % 2
                        out[slot, real] += v[2 * p + j][c]
                        hits[slot, real] += 1
    return out, hits


@pytest.mark.parametrize("groups", [4, 2], ids=["whole", "pair"])
def test_permuted_contribution_rows_reach_each_real_column_once(groups):
    """The permuted contribution rows (unpaired; the pair's halves with det_pair_perm) read back through the reduce's
    column map: every accumulator element lands in its own real column once; a pair's two halves make the tile."""
    import numpy as np

    tile = np.random.default_rng(3).standard_normal((64, 64))
    if groups == 4:
        out, hits = _contrib_perm_model(tile)
        assert (hits == 1).all() and np.array_equal(out, tile)
    else:
        (o0, h0), (o1, h1) = _contrib_perm_model(tile, 2, 0), _contrib_perm_model(tile, 2, 1)
        assert (h0[:, :32] == 1).all() and (h0[:, 32:] == 0).all() and (h1[:, 32:] == 1).all()
        assert (h1[:, :32] == 0).all() and np.array_equal(o0 + o1, tile)


def _slot_values(q, kv, idx, dout, scale, dv):
    """float64 dkv values of the deterministic mode: [head blocks, T, K, Dqk] (0 on invalid slots), and the
    out the forward would give."""
    q, kv, dout = q.double(), kv.double(), dout.double()
    valid = idx >= 0
    kvg = kv[idx.clamp(min=0).long()]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q, kvg) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
    out = torch.einsum("thk,tkd->thd", p, kvg[..., :dv])
    ds = p * (torch.einsum("thd,tkd->thk", dout, kvg[..., :dv]) - (out * dout).sum(-1, keepdim=True)) * scale
    blocks = []
    for h0 in range(0, q.shape[1], 64):
        hs = slice(h0, h0 + 64)
        v = torch.einsum("thk,thd->tkd", ds[:, hs], q[:, hs])
        v[..., :dv] += torch.einsum("thk,thd->tkd", p[:, hs], dout[:, hs])
        blocks.append(v * valid[..., None])
    return torch.stack(blocks), out


def _maxima(q, out, dout):
    """The preprocess's maxima [Tq, NHB16, threads, 3] as the fixed-point scale reads them (here one entry)."""
    return torch.stack([t.float().abs().amax() for t in (q, out, dout)]).view(1, 1, 1, 3)


def test_fixed_point_scale_bounds_every_sum_and_keeps_the_precision():
    """The deterministic mode's power of two: every kv row's sum of |values| stays under 2**60 (no partial
    sum can wrap int64), while the sums themselves span far more bits than an fp32 mantissa's 24."""
    import math

    g = torch.Generator().manual_seed(0)
    T_, H, Dqk, Dv, N, K = 24, 128, 576, 512, 40, 64
    q = torch.randn(T_, H, Dqk, generator=g).bfloat16()
    kv = torch.randn(N, Dqk, generator=g).bfloat16()
    dout = (0.1 * torch.randn(T_, H, Dv, generator=g)).bfloat16()
    idx = torch.randint(0, N, (T_, K), generator=g).int()
    idx[:, -5:] = -1
    idx[3] = 7  # one row names a key 59 times (duplicates count)
    scale = Dqk ** -0.5
    values, out = _slot_values(q, kv, idx, dout, scale, Dv)
    fix_limit, unfix = bwd._fixed_point_scale(_maxima(q, out.bfloat16(), dout), kv, idx, N, H, Dv, scale)
    f, limit = fix_limit.tolist()
    assert fix_limit.dtype == torch.float32 and unfix.dtype == torch.float64 and f * unfix.item() == 1.0
    assert math.log2(f).is_integer()
    # every value stays under the limit the kernel checks, and the most values one row gets under it sum below 2**60
    counts = torch.bincount(idx[idx >= 0].long(), minlength=N).max().item() * 2  # two head blocks
    assert values.abs().max().item() * f <= limit and limit * counts <= 2.0**60 * (1 + 1e-6)
    abs_sums = torch.zeros(N, Dqk, dtype=torch.float64)
    sums = torch.zeros(N, Dqk, dtype=torch.float64)
    rows = idx.clamp(min=0).long().reshape(-1)
    for blk in values:
        abs_sums.index_add_(0, rows, blk.abs().reshape(-1, Dqk))
        sums.index_add_(0, rows, blk.reshape(-1, Dqk))
    assert abs_sums.max().item() * f < 2.0**60
    assert sums.abs().max().item() * f > 2.0**36, math.log2(sums.abs().max().item() * f)
    # non-finite kv entries are left out of its maximum (their values go to dkv as they are; the
    # preprocess leaves those of q, out and dout out of its maxima: a GPU test checks it)
    kv_nan = kv.clone()
    kv_nan[0, 0] = float("nan")
    kv_nan[1, 0] = float("inf")
    assert bwd._fixed_point_scale(_maxima(q, out.bfloat16(), dout), kv_nan, idx, N, H, Dv, scale)[0][0].item() == f
    # a negative scale gives the same bound (its magnitude counts)
    assert bwd._fixed_point_scale(_maxima(q, out.bfloat16(), dout), kv, idx, N, H, Dv, -scale)[0][0].item() == f
    # nothing to add (dout 0): a finite scale all the same
    zero = bwd._fixed_point_scale(_maxima(q, out.bfloat16(), torch.zeros_like(dout)), kv, idx, N, H, Dv, scale)
    assert all(math.isfinite(x) and x > 0 for t in zero for x in t.tolist())


@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("dqk,heads", [(576, 128), (96, 16)], ids=["D576-2blocks", "D96-partial-run"])
def test_contribution_reduce_compiles_with_warps_taking_slots_in_turn(dqk, heads):
    """The "contrib" reduce: one CTA per kv row, each warp reading whole contribution rows as 64-column
    runs (float2 per lane; a partial last run where dqk is not a multiple of 64), the warps' sums combined
    through shared memory in warp order."""
    cfg = {"heads": heads, "dqk": dqk, "dv": 64 if dqk == 96 else 512, "det_mode": "contrib"}
    src = bwd.build_bwd_program(cfg, "reduce", target=SM90A).get_kernel_source()
    assert "float2" in src and "__syncthreads()" in src and "Rows[" in src
    loop = src[src.index("for (int it = 0;"):src.index("__syncthreads()")]
    assert "float2" in loop and ("< 3)" in loop) == (dqk == 96)  # the partial run: 1.5 runs of 64 (3 halves)


@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_contribution_reduce_loads_rows_without_safe_memory_guards():
    """The reduce is compiled without TileLang's safe-memory pass (1.05-1.09x at MLA, deterministic mode, H200): the
    rows it names through Rows are loaded straight, not behind a bounds test on the row and a zero-filled
    fallback; the program's own column tests and the exponent byte's clamp stay."""
    src = contrib_reduce.build_reduce(576, 1, "int16", 8, True, target=SM90A).get_kernel_source()
    loop = src[src.index("for (int it = 0;"):src.index("__syncthreads()")]
    assert "Contrib[" in loop or "(Contrib +" in loop
    assert "base < M" not in loop and "make_short4" not in loop
    assert "min(" in loop  # the exponent byte's block index, clamped by the program itself
    partial = contrib_reduce.build_reduce(96, 1, "float32", target=SM90A).get_kernel_source()
    assert "< 96)" in partial or "< 3)" in partial  # a partial last run keeps its column test


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_contribution_rows_from_the_ws_program_compile():
    """det_mode "contrib_ws" (not yet measured on a GPU): the ws program stores each valid slot's values in
    its own contribution row (streaming full-line stores, no reduction of any kind) for the reduce."""
    cfg = {"heads": 128, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "det_mode": "contrib_ws"}
    assert bwd.bwd_program_names(cfg) == ("main", "main_probs", "main_det", "main_det_probs", "reduce")
    # without ws_fused_pre (or with det_mode "contrib", whose plain program reads Delta) the preprocess runs
    assert bwd.bwd_program_names({**cfg, "ws_fused_pre": False})[0] == "preprocess"
    assert bwd.bwd_program_names({**cfg, "det_mode": "contrib"})[0] == "preprocess"
    for name in ("main_det", "main_det_probs"):
        det = bwd.build_bwd_program(cfg, name, target=SM90A).get_kernel_source()
        assert "dsa_red_tile<3, 4, false, true>(" in det and "dsa_red_tile<0" not in det  # columns permuted
        assert "__named_barrier_arrive" in det


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("mode,ctype,store", [("contrib_bf16", "bfloat16_t", 4), ("contrib_i16", "short", 5)])
def test_rounded_contribution_rows_compile_with_their_reduce(mode, ctype, store):
    """det_mode "contrib_bf16" / "contrib_i16": the ws program stores each valid slot's values as bf16, or as
    int16 with a power of two per block of 8 values (an exponent byte each, Scales), and the reduce reads
    128-column runs of them (8 bytes a lane; int16 times its block's power of two), summing in fp32."""
    cfg = {"heads": 64, "dqk": 576, "dv": 512, "has_sink": False, "dtype": "bfloat16", "det_mode": mode}
    assert bwd.bwd_program_names(cfg)[-1] == "reduce"
    det = bwd.build_bwd_program(cfg, "main_det", target=SM90A).get_kernel_source()
    assert f"dsa_red_tile<{store}, 4, false, true>(" in det and f"{ctype}* __restrict__ dKV" in det
    assert ("Scales[" in det or "(&(Scales[0]))" in det)
    red = bwd.build_bwd_program(cfg, "reduce", target=SM90A).get_kernel_source()
    loop = red[red.index("for (int it = 0;"):red.index("__syncthreads()")]
    assert f"{ctype}* __restrict__ Contrib" in red and ("uint2" in loop or "short4" in loop)
    assert "< 9)" in loop  # 576 = 4.5 runs of 128 (9 halves): the last one half the lanes
    assert ("Exps[" in loop and "<< (uint)23" in loop) == (mode == "contrib_i16")
    if mode == "contrib_i16":  # real column order: a lane's 4 columns: 64-column chunk 2 r + lane / 16, group lane % 8
        red = bwd.build_bwd_program({**cfg, "ws_dkv_perm": False}, "reduce", target=SM90A).get_kernel_source()
        loop = red[red.index("for (int it = 0;"):red.index("__syncthreads()")]
        assert "* (int64_t)16) + (((((int64_t)((int)threadIdx.x)) & (int64_t)31) >> (int64_t)4) * (int64_t)8))" \
               " + (((int64_t)((int)threadIdx.x)) & (int64_t)7)" in loop


def test_int16_block_scale_bounds_every_value():
    """dsa_i16_scale (the "contrib_i16" store) mirrored in Python: for a block whose largest magnitude is m the
    scale is a power of two with m * scale < 2^14 <= 2 m * scale (values fit int16, none lose more than one bit
    of the range) unless e is clamped at -112 (m below 2^-112: both stay normal floats), the stored inverse is
    exact, and a block that is not finite gets the exponent byte 255 (inf in the reduce, times its zeros: NaN)."""
    src = bwd._WS_PRELUDE
    assert "(m >> 23) - 126, -112), 128)" in src and "(141 - e) << 23" in src and "(113 + e) << 23" in src
    assert "if (m >= 0x7f800000u) return make_float2(0.0f, __int_as_float(0x7fffffff));" in src
    g = torch.Generator().manual_seed(0)
    m = torch.rand(10_000, generator=g) * torch.logspace(-37, 38, 10_000)
    m = torch.cat([m, torch.tensor([0.0, 1e-45, 1e-40, 2.0**-112, 2.0**-113, 1.0, 2.0**-20, 3.0e38])])
    bits = m.view(torch.int32).to(torch.int64)
    e = ((bits >> 23) - 126).clamp(-112, 128)
    scale = ((141 - e) << 23).to(torch.int32).view(torch.float32)
    inverse = ((113 + e) << 23).to(torch.int32).view(torch.float32)
    scaled = m.double() * scale.double()
    assert (scaled < 2**14).all()
    assert (scaled[e > -112] >= 2**13).all() and (scaled[e == -112] < 2**14).all()
    assert torch.equal(scale.double() * inverse.double(), torch.ones_like(scaled))
    # the exponent byte of the inverse, as the ws program stores it, reads back as the inverse
    byte = (inverse.view(torch.int32) >> 23) & 0xFF
    assert torch.equal((byte << 23).to(torch.int32).view(torch.float32), inverse)
    nan_inverse = torch.tensor([0x7FFFFFFF], dtype=torch.int32)
    assert ((nan_inverse >> 23) & 0xFF).item() == 255
    assert torch.isinf(torch.tensor([255 << 23], dtype=torch.int32).view(torch.float32)).all()


def test_int16_rounding_by_the_magic_constant_matches_round_half_even():
    """dsa_i16x2 mirrored: fma(v, scale, 1.5 * 2^23) in fp32 keeps round-half-even(v * scale) in its low 16 bits
    (two's complement) for |v * scale| <= 2^14."""
    assert "fmaf(lo, scale, 12582912.0f)" in bwd._WS_PRELUDE and "0x5410" in bwd._WS_PRELUDE
    x = torch.cat([(torch.rand(200_000) * 2 - 1) * 2**14, torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 16384.0, -16384.0])])
    f = (x.double() + 12582912.0).float()  # x is exact in fp32 here, so this is the fma's single rounding
    low = (f.view(torch.int32) & 0xFFFF).to(torch.int16)
    assert torch.equal(low.to(torch.float64), torch.round(x.double()))  # torch.round: half to even


@pytest.mark.parametrize("pair", [False, True], ids=["whole-tiles", "pair-halves"])
def test_int16_blocks_written_by_the_ws_program_are_the_ones_the_reduce_reads(pair):
    """The "contrib_i16" block of each column, as the ws program's lanes write it (dsa_red_tile: lane q, g of
    a quad-row pair holds columns col0 + 16 (2 mp + gb) + 8 odd + 4 (q >> 1) + 0..3, mp = 0, 1, and writes the
    byte col0 / 8 + 4 gb + 2 odd + (q >> 1)) and as the reduce reads it (col // 64 * 8 + col % 32 // 4). A CTA of
    a pair (det_pair) holds half of each chunk (col0 + 32 rank, mp = 0 only) and writes one byte per 4 columns,
    col0 / 4 + 4 gb + 2 odd + (q >> 1), which the reduce reads as col // 4."""
    import inspect

    assert "(kGroups == 4 ? col0 / 8 : col0 / 4) + 4 * gb + 2 * odd + (q >> 1)" in bwd._WS_PRELUDE
    reduce_src = inspect.getsource(contrib_reduce.reduce_body)
    assert "col // 64 * 8 + col % 32 // 4" in reduce_src and "T.min(col // 4, dqk // 4 - 1)" in reduce_src
    for dqk in (512,) if pair else (512, 576):
        written = {}
        for chunk in range(0, dqk, 64):
            for rank in (0, 1) if pair else (0,):
                col0 = chunk + 32 * rank if pair else chunk
                for lane in range(32):
                    q, g = lane & 3, lane >> 2
                    odd, gb = q & 1, g & 1
                    blk = (col0 // 4 if pair else col0 // 8) + 4 * gb + 2 * odd + (q >> 1)
                    for mp in (0,) if pair else (0, 1):
                        for c in range(4):
                            col = col0 + 16 * (2 * mp + gb) + 8 * odd + 4 * (q >> 1) + c
                            assert written.setdefault(col, blk) == blk
        assert sorted(written) == list(range(dqk))
        read = (lambda col: col // 4) if pair else (lambda col: col // 64 * 8 + col % 32 // 4)
        assert all(written[col] == read(col) for col in range(dqk))


def test_permuted_int16_blocks_written_are_the_ones_the_reduce_reads():
    """With ws_dkv_perm the ws program's lane q stores its 8 values of groups 2 p and 2 p + 1 of a contribution row
    side by side at columns col0 + 32 p + 8 q + 0..7 (group 2 p + j at + 4 j: real columns col0 + 16 (2 p + j) + 2 q +
    (0, 1, 8, 9)) and the exponent bytes of its two blocks as one 16-bit word at byte col0 / 8 + 2 q (block p at + p);
    the reduce reads col // 64 * 8 + col % 32 // 8 * 2 + col % 64 // 32 and sends the sum of stored column col to
    real column col // 32 * 32 + col % 8 // 4 * 16 + col % 4 // 2 * 8 + col % 32 // 8 * 2 + col % 2: every column
    once. (The atomic reductions keep their own order, groups of 16: ``_dkv_cols_permuted``.)"""
    import inspect

    assert "exps + (row0 + slot) * (ld / 8) + col0 / 8 + 2 * q) =" in bwd._WS_PRELUDE
    # a pair's half tile (det_pair_perm): block p0 = its rank of the same layout, one byte
    assert "exps[(row0 + slot) * (ld / 8) + chunk0 / 8 + 2 * q + p0] =" in bwd._WS_PRELUDE
    assert "both |= (__float_as_uint(sc[p].y) >> 23) << (8 * p);" in bwd._WS_PRELUDE
    assert "st + 32 * p * kBytes, v[2 * p], v[2 * p + 1], sc[p].x" in bwd._WS_PRELUDE
    assert "contrib + ((row0 + slot) * ld + col0 + 8 * q) * kBytes" in bwd._WS_PRELUDE
    reduce_src = inspect.getsource(contrib_reduce.reduce_body)
    assert "col // 64 * 8 + col % 32 // 8 * 2 + col % 64 // 32" in reduce_src
    assert "col // 32 * 32 + col % 8 // 4 * 16 + col % 4 // 2 * 8 + col % 32 // 8 * 2 + col % 2" in reduce_src
    for dqk in (512, 576):
        written, real = {}, {}
        for col0 in range(0, dqk, 64):
            for q in range(4):
                for p in range(2):
                    for j in range(2):
                        for c in range(4):
                            col = col0 + 32 * p + 8 * q + 4 * j + c
                            assert written.setdefault(col, col0 // 8 + 2 * q + p) == col0 // 8 + 2 * q + p
                            real[col] = col0 + 16 * (2 * p + j) + 2 * q + (0, 1, 8, 9)[c]  # the accumulator's
        assert sorted(written) == list(range(dqk)) and sorted(real.values()) == list(range(dqk))
        assert all(written[col] == col // 64 * 8 + col % 32 // 8 * 2 + col % 64 // 32 for col in range(dqk))
        assert all(real[col] == col // 32 * 32 + col % 8 // 4 * 16 + col % 4 // 2 * 8 + col % 32 // 8 * 2 + col % 2
                   for col in range(dqk))
        # the atomic reductions' columns: within each group of 16, real column 8 h + 2 q + e at 4 q + 2 h + e
        perm = bwd._dkv_cols_permuted(torch.arange(dqk).float().view(1, dqk))[0].long().tolist()
        assert all(perm[col] == col // 16 * 16 + col % 4 // 2 * 8 + col % 16 // 4 * 2 + col % 2 for col in range(dqk))


def test_det_pair_perm_stores_the_pairs_rows_in_the_unpaired_layout():
    """det_pair_perm (the default): the pair's CTAs store their halves of each chunk as block p = rank of the permuted
    layout, so the reduce reads the pair's rows with the unpaired rows' maps and int16 blocks of 8; turned off, the
    pair keeps its real column order and blocks of 4."""
    v4 = {"heads": 128, "dqk": 512, "dv": 512, "has_sink": True, "dtype": "bfloat16"}
    off, on = bwd._normalise_config({**v4, "det_pair_perm": False}), bwd._normalise_config(v4)
    assert not off["det_pair_perm"] and on["det_pair_perm"] and on["det_pair"]
    assert bwd._program_key(off, "reduce") == ("reduce", (512, 1, "int16", 4))
    assert bwd._program_key(on, "reduce") == ("reduce", (512, 1, "int16", 8, True))
    # not where the pair cannot run (MLA's 576-wide rows), nor without ws_dkv_perm
    assert not bwd._normalise_config({**v4, "dqk": 576, "det_pair_perm": True})["det_pair_perm"]
    assert not bwd._normalise_config({**v4, "ws_dkv_perm": False, "det_pair_perm": True})["det_pair_perm"]
    pytest.importorskip("tilelang")
    src = bwd.build_bwd_program(v4, "main_det", target=SM90A).get_kernel_source()
    assert "dsa_pair_finish<5, true, true>" in src
    assert "const int chunk0 = col0 & ~63, p0 = (col0 >> 5) & 1;" in src


@pytest.mark.parametrize("nhb", [1, 2])
@pytest.mark.parametrize("n_rows", [50, 32767, 32768, 40000])  # int16 sort keys up to 32767 rows, int32 above
def test_slot_order_gives_each_kv_row_its_slots_in_order(nhb, n_rows):
    """The reduce's order (computed on a side stream on a GPU, inline on the CPU): RowPtr[n]:RowPtr[n + 1] of
    Rows are the contribution rows (head block 0) of the slots naming kv row n, in slot order, duplicates
    kept; invalid slots (-1) in no range. Kv rows on both sides of the int16 sort keys' limit."""
    g = torch.Generator().manual_seed(1)
    t, kp = 7, 64
    idx = torch.randint(-1, n_rows, (t, kp), generator=g, dtype=torch.int32)
    idx[0, :10] = 3  # duplicates in one row
    idx[1] = -1  # a row without a valid slot
    idx[2, :8] = n_rows - 1  # the last kv row, duplicated
    idx[2, 8:12] = torch.tensor([n_rows - 1, 0, n_rows - 2, 0], dtype=torch.int32)
    rows, rowptr = contrib_reduce.slot_order_async(idx, n_rows, kp, nhb)()
    assert rows.dtype == rowptr.dtype == torch.int32 and rowptr.shape == (n_rows + 1,)
    flat = idx.reshape(-1).tolist()
    valid = sorted((s for s in range(t * kp) if flat[s] >= 0), key=lambda s: flat[s])  # Python's sort is stable
    want_rows = [(s // kp) * nhb * kp + s % kp for s in valid]
    want_ptr = [0] + torch.bincount(idx[idx >= 0].long(), minlength=n_rows).cumsum(0).tolist()
    assert rows[:len(valid)].tolist() == want_rows
    assert rowptr.tolist() == want_ptr


def test_chunk_rows_fills_the_budget_with_whole_rows():
    """contrib_reduce.chunk_rows: as many query rows as the budget holds, at least 1, at most all; the chunks of
    the model shapes at the 2 GiB default (int16 rows with an exponent byte per 8 values)."""
    gib2 = 2 << 30
    assert contrib_reduce.chunk_rows(4096, 2048 * (576 * 2 + 72), gib2) == 856  # MLA H64: 5 chunks
    assert contrib_reduce.chunk_rows(4096, 2 * 2048 * (576 * 2 + 72), gib2) == 428  # MLA H128: two rows a slot
    assert contrib_reduce.chunk_rows(4096, 1024 * (512 * 2 + 64), gib2) == 1927  # V4 H128, the pair: one a slot
    assert contrib_reduce.chunk_rows(500, 1000, gib2) == 500  # one chunk holds every row
    assert contrib_reduce.chunk_rows(4096, 10_000, 10) == 1  # never below one row
    assert contrib_reduce.chunk_rows(0, 10_000, gib2) == 1


def test_deterministic_env_names_the_mode(monkeypatch, caplog):
    """DSA_PLUGINS_DETERMINISTIC=<mode> turns the deterministic backward on with that mode where the config
    names none; 1 keeps the default; an unknown name is an error naming the variable; a ws-only mode on a
    shape the ws program does not take falls back to "contrib" with one warning."""
    from dsa_plugins.common import settings

    ws = {"heads": 64, "dqk": 576, "dv": 512}
    plain = {"heads": 16, "dqk": 96, "dv": 64}
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "1")
    assert settings.deterministic_enabled() and settings.deterministic_mode() is None
    assert bwd._normalise_config(ws)["det_mode"] == "contrib_i16"  # the ws shapes' default
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "contrib_i16")
    assert settings.deterministic_enabled() and settings.deterministic_mode() == "contrib_i16"
    assert bwd._normalise_config(ws)["det_mode"] == "contrib_i16"
    assert bwd._normalise_config({**ws, "det_mode": "fixed"})["det_mode"] == "fixed"  # the config wins
    assert bwd.bwd_program_names(ws)[-1] == "reduce"
    with caplog.at_level(logging.WARNING, logger="dsa_plugins"):
        assert bwd._normalise_config(plain)["det_mode"] == "contrib"
        assert bwd._normalise_config(plain)["det_mode"] == "contrib"
    assert len([r for r in caplog.records if "DSA_PLUGINS_DETERMINISTIC=contrib_i16" in r.getMessage()]) == 1
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "exact")
    assert settings.deterministic_enabled()
    with pytest.raises(ValueError, match="DSA_PLUGINS_DETERMINISTIC must be 0, 1 or a deterministic mode"):
        bwd._normalise_config(ws)
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "off")
    assert not settings.deterministic_enabled() and settings.deterministic_mode() is None
