"""CPU test: every shipped configuration of the sparse attention forward compiles for sm_90a, and
the wrapper rejects bad inputs with a message that names the tensor."""

import importlib.util
import re

import pytest
import torch

from dsa_plugins.kernels import sparse_attention_fwd as mod
from tests.helpers import assert_waits_for_previous_grid

SM90A = {"kind": "cuda", "arch": "sm_90a"}
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def test_module_imports_without_tilelang_side_effects():
    assert callable(mod.sparse_attention_fwd)
    assert mod.SHIPPED_CONFIGS
    keys = {tuple(mod._normalise_config(c).items()) for c in mod.SHIPPED_CONFIGS}
    assert len(keys) == len(mod.SHIPPED_CONFIGS), "SHIPPED_CONFIGS has duplicates"
    # the two model families the package ships
    shapes = {(c["dim_qk"], c["dim_v"], c["has_sink"]) for c in mod.SHIPPED_CONFIGS}
    assert (512, 512, True) in shapes and (576, 512, False) in shapes
    # prefill and generation steps left whole run the seesaw schedule; rows cut into parts (merged in a
    # cluster) qk_one, the only schedule with such programs
    for dims in shapes:
        assert mod.config_for(*dims, torch.bfloat16)["schedule"] == "seesaw"
    assert {mod._normalise_config(c)["schedule"] for c in mod.SHIPPED_CONFIGS} == {"seesaw"}
    assert mod.PARTS_SCHEDULE == "qk_one"
    assert all(mod._normalise_config(c)["schedule"] == "qk_one" for c in mod.DECODE_CLUSTER_CONFIGS)
    # the programs that exist for qk_one only take it when no schedule is named
    assert mod._normalise_config({"persistent_ctas": 5})["schedule"] == "qk_one"
    assert mod._normalise_config({"partial": True})["schedule"] == "qk_one"
    with pytest.raises(ValueError, match="partial"):
        mod._normalise_config({"partial": True, "schedule": "seesaw"})


def _kv_gathers_are_64_bit(src: str) -> bool:
    """Every gather of a kv row addresses the cache in 64 bits (batch entry x seqlen_kv in int64): the ops layer
    runs caches of 2**31 elements or more in one launch on it."""
    offsets = re.findall(r"&\(KV\[(.*?)\]\)\)", src)
    # (int64_t)<batch entry: blockIdx.z, or the persistent grid's bz>) * ((int64_t)seqlen_kv)
    return bool(offsets) and all(re.search(r"\(int64_t\)\S+\) \* \(\(int64_t\)seqlen_kv\)", o) for o in offsets)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
@pytest.mark.parametrize("config", mod.SHIPPED_CONFIGS,
                         ids=lambda c: f"{c['dim_qk']}-{c['dim_v']}-sink{int(c['has_sink'])}-{mod._normalise_config(c)['schedule']}")
def test_shipped_config_compiles_for_sm90a(config, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="dsa_plugins"):
        kernel = mod.build_fwd_kernel(config, target=SM90A)
    src = kernel.get_kernel_source()
    assert "wgmma" in src and ("cp.async" in src or "cp_async" in src)
    # Q in by TMA (evict_first: read once) and the output out by TMA stores, waited for before exit
    assert "tma_load<tl::CacheHintSm90::EVICT_FIRST>(Q_desc" in src and "tma_store(Output_desc" in src
    assert "tma_store_wait" in src
    # the softmax's exponentials as one ex2.approx.ftz each (fast_exp2, the default)
    assert "dsa_ex2_ftz(" in src and "ex2.approx.ftz.f32" in src
    # dynamic shapes: lengths, heads and K are kernel parameters, the scale a runtime scalar
    for name in ("seqlen", "seqlen_kv", "heads", "topk_padded", "scale"):
        assert name in src, f"{name} is not a runtime parameter"
    assert _kv_gathers_are_64_bit(src)
    # a second request is served from the cache without compiling again
    assert mod.build_fwd_kernel(dict(config), target=SM90A) is kernel
    # the seesaw runs without TileLang's automatic warpgroup syncs (ids below ours): only the program's own
    # named barriers; the other schedules keep them
    ids = {int(i) for i in re.findall(r"__sync_thread_partial\((\d+), \d+\)", src)}
    seesaw = mod._normalise_config(config)["schedule"] == "seesaw"
    assert ids and (min(ids) >= mod._BAR_NEXT) == seesaw, sorted(ids)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
@pytest.mark.parametrize("variant", [{"schedule": "seesaw"}, {"schedule": "seesaw", "has_sink": True, "dim_qk": 512},
                                     {"load_hint": "l2_256_keep"},
                                     {"persistent_ctas": 132, "has_sink": True, "dim_qk": 512},
                                     {"tma_io": False}, {"tma_io": False, "has_sink": True, "dim_qk": 512},
                                     {"fast_exp2": False}],
                         ids=["seesaw-576", "seesaw-512-sink", "l2_keep", "persistent-512-sink", "thread_io-576",
                              "thread_io-512-sink", "exp2f-576"])
def test_forward_variants_compile_for_sm90a(variant):
    """The opt-in variants (the seesaw schedule, the gather hints, the persistent grid, TMA for Q and the
    output off) compile for sm_90a."""
    kernel = mod.build_fwd_kernel({**mod.DEFAULT_CONFIG, **variant}, target=SM90A)
    src = kernel.get_kernel_source()
    assert "wgmma" in src and _kv_gathers_are_64_bit(src)
    if "load_hint" in variant:
        assert "dsa_cp_async16<2>" in src and "evict_last" in src
    if "fast_exp2" in variant:  # the softmax back on exp2f (denormal results kept)
        assert "dsa_ex2_ftz" not in src and "exp2f(" in src
    if "persistent_ctas" in variant:  # a row-block loop whose barrier phases run on across blocks
        assert "* 132) + ((int)blockIdx.x)" in src and "(base" in src
    if variant.get("tma_io") is False:  # Q and the output copied by the threads, no TMA
        assert "tma_load(" not in src and "tma_store(" not in src and "(Output + " in src


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
@pytest.mark.parametrize("dims", [(576, 512), (512, 512)], ids=lambda d: f"{d[0]}-{d[1]}")
def test_decode_split_programs_compile_for_sm90a(dims):
    """DSA_PLUGINS_DECODE_PART_SLOTS's programs: the partial forward (fp32 partials, parts as rows of
    their own) and the combine, with and without a sink."""
    dqk, dv = dims
    kernel = mod.build_fwd_kernel({**mod.DEFAULT_CONFIG, "dim_qk": dqk, "dim_v": dv, "partial": True}, target=SM90A)
    src = kernel.get_kernel_source()
    assert "rows_out" in src and "float* __restrict__ Output" in src
    assert _kv_gathers_are_64_bit(src)
    for sink in (False, True):
        src = mod.build_combine_kernel(dv, sink, "bfloat16", target=SM90A).get_kernel_source()
        assert "parts" in src and ("Sinks[" in src) == sink
    with pytest.raises(ValueError, match="no sink"):
        mod._normalise_config({"dim_qk": dqk, "dim_v": dv, "partial": True, "has_sink": True})


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
@pytest.mark.parametrize("config", mod.DECODE_CLUSTER_CONFIGS + [{**mod.SHIPPED_CONFIGS[1], "cluster_parts": 8},
                                    {**mod.SHIPPED_CONFIGS[0], "cluster_parts": 2, "schedule": "seesaw"}],
                         ids=lambda c: f"{c['dim_qk']}-{c['dim_v']}-sink{int(c['has_sink'])}-parts{c['cluster_parts']}"
                                       f"-{mod._normalise_config(c)['schedule']}")
def test_decode_cluster_programs_compile_for_sm90a(config):
    """The decode split merged inside a cluster, as the 64-head models' generation steps take it (2 parts)
    and with DSA_PLUGINS_DECODE_ROW_CTAS=8 (8 parts): cluster launch, peer loads through distributed shared
    memory between two cluster barriers, and the output written by the merge (not by TMA)."""
    parts, sink = config["cluster_parts"], config["has_sink"]
    kernel = mod.build_fwd_kernel(config, target=SM90A)
    src = kernel.get_kernel_source()
    assert "rows_out" in src and "mapa.shared::cluster" in src and "ld.shared::cluster.v4" in src
    assert src.count("dsa_cluster_sync();") == 2 + 2 * 2  # producer twice, each consumer twice
    assert_waits_for_previous_grid(src)  # a cluster launch may overlap the program that wrote its inputs
    assert "tma_store(Output_desc" not in src and ("Sinks[" in src) == sink
    assert _kv_gathers_are_64_bit(src)  # generation steps over B 32 x 128K x 576 caches: one launch


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
def test_cluster_launch_experiment_waits_for_the_previous_grid():
    """The cluster-launch experiment (``cluster``, off by default) is a cluster launch too: TileLang allows it to
    overlap the previous kernel, so it waits for that kernel's writes before reading its inputs."""
    src = mod.build_fwd_kernel({**mod.SHIPPED_CONFIGS[0], "cluster": "heads"}, target=SM90A).get_kernel_source()
    assert_waits_for_previous_grid(src)
    assert "dsa_grid_dependency_wait" not in mod.build_fwd_kernel(mod.SHIPPED_CONFIGS[0], target=SM90A).get_kernel_source()


def test_config_validation():
    with pytest.raises(ValueError, match="dim_v"):
        mod._normalise_config({"dim_qk": 512, "dim_v": 500})
    with pytest.raises(ValueError, match="dim_qk"):
        mod._normalise_config({"dim_qk": 520, "dim_v": 512})
    with pytest.raises(ValueError, match="dtype"):
        mod._normalise_config({"dtype": "float32"})
    with pytest.raises(ValueError, match="schedule"):
        mod._normalise_config({"schedule": "nope"})
    with pytest.raises(ValueError, match="load_hint"):
        mod._normalise_config({"load_hint": "nope"})
    assert mod._normalise_config({"schedule": "seesaw"})["consumer_regs"] == (224, 224)
    # TileLang's automatic syncs: off for the seesaw only (its barriers were checked), and not to be turned off
    # elsewhere
    assert mod._normalise_config({"schedule": "seesaw"})["auto_sync"] is False
    assert mod._normalise_config({"schedule": "qk_one"})["auto_sync"] is True
    assert mod._normalise_config({"schedule": "seesaw", "auto_sync": True})["auto_sync"] is True
    with pytest.raises(ValueError, match="auto_sync=False is verified for the seesaw schedule only"):
        mod._normalise_config({"schedule": "qk_one", "auto_sync": False})
    with pytest.raises(ValueError, match="persistent_ctas"):
        mod._normalise_config({"schedule": "seesaw", "persistent_ctas": 132})
    with pytest.raises(ValueError, match="persistent_ctas"):
        mod._normalise_config({"partial": True, "persistent_ctas": 132})
    # the partial and persistent programs stage Q and the output with threads
    assert mod._normalise_config({})["tma_io"] is True
    assert mod._normalise_config({"partial": True})["tma_io"] is False
    assert mod._normalise_config({"persistent_ctas": 132})["tma_io"] is False
    with pytest.raises(ValueError, match="504"):  # more than the CTA's registers: setmaxnreg would hang
        mod._normalise_config({"producer_regs": 56, "consumer_regs": (256, 208)})
    assert mod._normalise_config({"consumer_regs": 224})["consumer_regs"] == (224, 224)
    # the decode split merged in a cluster: 2, 4 or 8 parts, the plain qk_one and seesaw programs only
    assert mod._normalise_config({})["cluster_parts"] == 0
    assert mod._normalise_config({"cluster_parts": 1})["cluster_parts"] == 0
    assert mod._normalise_config({"cluster_parts": 8, "has_sink": True})["cluster_parts"] == 8
    for bad in ({"cluster_parts": 3}, {"cluster_parts": 16}):
        with pytest.raises(ValueError, match="cluster_parts must be"):
            mod._normalise_config(bad)
    assert mod._normalise_config({"cluster_parts": 2, "schedule": "seesaw"})["schedule"] == "seesaw"
    for bad in ({"schedule": "split"}, {"partial": True}, {"persistent_ctas": 132}, {"cluster": "rows"}):
        with pytest.raises(ValueError, match="cluster_parts takes"):
            mod._normalise_config({"cluster_parts": 4, **bad})
    # the cluster-launch experiment: off by default, two layouts, the plain grid only
    assert mod._normalise_config({})["cluster"] is None
    assert mod._normalise_config({"cluster": "heads"})["cluster"] == "heads"
    with pytest.raises(ValueError, match="cluster must be one of"):
        mod._normalise_config({"cluster": "quad"})
    with pytest.raises(ValueError, match="cluster takes the plain grid"):
        mod._normalise_config({"cluster": "rows", "persistent_ctas": 132})
    # together with a gather hint the program faulted on an H200 (illegal instruction): refused with both names
    for hint in ("l2_256", "l2_256_keep"):
        with pytest.raises(ValueError, match=f"cluster='heads' cannot be combined with load_hint='{hint}'"):
            mod._normalise_config({"cluster": "heads", "load_hint": hint})
    assert mod._normalise_config({"load_hint": "l2_256_keep"})["load_hint"] == "l2_256_keep"
    cfg = mod.config_for(576, 512, False, torch.bfloat16)
    assert cfg["dim_qk"] == 576 and cfg["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mod.config_for(576, 512, False, torch.float32)


def _inputs(**over):
    d = dict(
        q=torch.zeros(1, 2, 16, 64, dtype=torch.bfloat16),
        kv=torch.zeros(1, 5, 64, dtype=torch.bfloat16),
        indices=torch.zeros(1, 2, 3, dtype=torch.int32),
        scale=0.125,
    )
    d.update(over)
    return d


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(q=torch.zeros(1, 2, 16, 64)), "q must have dtype"),
        (dict(q=torch.zeros(2, 16, 64, dtype=torch.bfloat16)), "q must have 4 dimensions"),
        (dict(kv=torch.zeros(1, 5, 64, dtype=torch.float16)), "kv must have dtype"),
        (dict(kv=torch.zeros(1, 5, 32, dtype=torch.bfloat16)), "kv must have size 64"),
        (dict(indices=torch.zeros(1, 2, 3)), "indices must have dtype"),
        (dict(indices=torch.zeros(1, 3, 3, dtype=torch.int32)), "indices must have size 2"),
        (dict(scale=-1.0), "scale"),
        (dict(scale=float("nan")), "scale"),
    ],
)
def test_wrapper_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        mod.sparse_attention_fwd(**_inputs(**over))


def test_wrapper_requires_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        mod.sparse_attention_fwd(**_inputs())


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
def test_skip_tail_variant_compiles_and_reads_row_trips():
    """The tuning variant that stops each row after its last valid slot (not shipped yet): every
    warpgroup's loop runs the row's own trip count."""
    src = mod.build_fwd_kernel({**mod.DEFAULT_CONFIG, "skip_tail": True}, target=SM90A).get_kernel_source()
    assert "RowTrips[" in src and src.count("< n_trips") >= 3


def test_decode_cluster_parts_depend_on_k_and_heads_only(monkeypatch):
    """The decode split's part count: DSA_PLUGINS_DECODE_ROW_CTAS CTAs a row (64-head blocks times parts),
    powers of two up to 8, at least 128 slots a part; never a function of the batch."""
    from dsa_plugins.common.settings import decode_cluster_parts

    monkeypatch.delenv("DSA_PLUGINS_DECODE_ROW_CTAS", raising=False)
    assert decode_cluster_parts(2048, 64) == 2 and decode_cluster_parts(512, 16) == 2
    assert decode_cluster_parts(2048, 128) == 0 and decode_cluster_parts(128, 64) == 0
    monkeypatch.setenv("DSA_PLUGINS_DECODE_ROW_CTAS", "8")
    assert decode_cluster_parts(2048, 64) == 8 and decode_cluster_parts(2048, 128) == 4
    assert decode_cluster_parts(512, 64) == 4 and decode_cluster_parts(300, 64) == 2
    monkeypatch.setenv("DSA_PLUGINS_DECODE_ROW_CTAS", "0")
    assert decode_cluster_parts(2048, 64) == 0
    for bad in ("-1", "two"):
        monkeypatch.setenv("DSA_PLUGINS_DECODE_ROW_CTAS", bad)
        with pytest.raises(ValueError, match="DSA_PLUGINS_DECODE_ROW_CTAS"):
            decode_cluster_parts(2048, 64)
