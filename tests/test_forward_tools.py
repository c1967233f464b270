"""The forward's measurement tools: the tracing tool patches the program's source as text (the patches
must keep applying); the A/B script parses and lists its shapes without a GPU."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, KERNELS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tool():
    return _load("trace_sparse_attention_fwd")


@pytest.mark.parametrize("ablate", [(), ("no_q", "no_store")])
def test_trace_patches_apply_to_the_forward_source(ablate):
    tool = _tool()
    src = tool.traced_source(ablate)
    compile(src, "traced_fwd.py", "exec")  # still Python
    # qk_one's consumers 10 stamps, the seesaw's 9 (with its producer's)
    assert src.count('"dsa_trace"') == 19 and "Trace: T.Tensor([TRN, 16]" in src
    assert ("h0 + hh < -1, Q[" in src) == ("no_q" in ablate)
    with pytest.raises(RuntimeError, match="the program changed"):
        tool._replace(src, "no such line", "x")


def test_ab_script_parses_and_lists_its_shapes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/peers first: undone after
    monkeypatch.setitem(sys.modules, "common", None)
    del sys.modules["common"]  # benchmarks/peers/common.py imported afresh
    ab = _load("ab_sparse_attention_fwd")
    with pytest.raises(SystemExit) as exc:
        ab.main(["--help"])
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out
    labels = [label for label, _make, _dv in ab.cases("prefill")]
    assert len(labels) == 7 and labels[0].endswith("k256")
    assert [label for label, _m, _d in ab.cases("decode")][0] == "B1 S1 H64 D576/512 k2048 cache32768"
    # other batches and caches, also those of 2**31 elements or more (B 128 x 32K x 576: one launch)
    labels = [label for label, _m, _d in ab.cases("decode", (32, 128), 16384)]
    assert labels == [f"B{b} S1 H{h} D576/512 k2048 cache16384" for h in (64, 128) for b in (32, 128)]
    assert [label for label, _m, _d in ab.cases("decode", (64, 128), 32768)] == [
        f"B{b} S1 H{h} D576/512 k2048 cache32768" for h in (64, 128) for b in (64, 128)]
    # DeepSeek-V4's decode rows (D512 with sink) beside MLA's
    labels = [label for label, _m, _d in ab.cases("decode", (1,), 16384, ("mla", "v4"))]
    assert labels == [f"B1 S1 H{h} D{d} k2048 cache16384" for d in ("576/512", "512/512 sink") for h in (64, 128)]


@pytest.mark.slow
def test_cluster_gather_probe_compiles_for_sm90a():
    """The probe of two CTAs sharing a gather compiles in its three modes; "share" forwards each half to
    the peer with bulk SM-to-SM copies and keeps the cluster together until both CTAs are done. Deeper
    pipelines with a hold per stage compile too (the decode's gather floor), and so do the TMA gathers."""
    pytest.importorskip("tilelang")
    probe = _load("probe_cluster_gather")
    sources = {mode: probe.build(576, mode, target={"kind": "cuda", "arch": "sm_90a"}).get_kernel_source()
               for mode in probe.MODES}
    # a cluster sync after the barriers are set up (peers arrive on them) and one before leaving
    assert "tma_store_cluster" in sources["share"] and sources["share"].count("tl::cluster_sync()") == 2
    assert "tma_store_cluster" not in sources["alone"] and "cluster_sync" not in sources["alone"]
    assert "ready[0].init(137)" in sources["share"] and "ready[0].init(256)" in sources["alone_cluster"]
    # the decode floor's pipelines: more stages of fewer rows, consumers that hold each stage
    deep = probe.build(576, "alone", target={"kind": "cuda", "arch": "sm_90a"}, distinct=True, stages=4, block=32,
                       hold_ns=800).get_kernel_source()
    assert "ready[3].init(256)" in deep and "ready[4]" not in deep and "dsa_hold(800)" in deep
    # rows gathered by TMA: 9 pieces of 64 columns a row from one lane per warp (an expect_tx each), or every
    # lane's pieces through the kv tensor map and one arrive.expect_tx of the block's 64 x 1152 bytes
    tma = {mode: probe.build(576, mode, target={"kind": "cuda", "arch": "sm_90a"}).get_kernel_source()
           for mode in probe.TMA_MODES}
    assert tma["tma_warp"].count("tl::tma_load(KV_desc") == 2 * 9 + 1 and "ready[0].init(4)" in tma["tma_warp"]
    assert "DSA_TMA_PIECE(0," in tma["tma_lanes"] and "DSA_ARRIVE_TX(1, 73728)" in tma["tma_lanes"]
    assert "ready[0].init(1)" in tma["tma_lanes"] and "cp.async" not in tma["tma_lanes"]


@pytest.mark.parametrize("fine", [False, True], ids=["phases", "fine"])
def test_trace_patches_apply_to_the_backward_source(fine):
    """The backward's tracing tool (clock laps per warpgroup phase of the ws program, and inside each dkv
    chunk with ``fine``) still patches in."""
    tool = _load("trace_sparse_attention_bwd")
    src = tool.traced_source(fine)
    compile(src, "traced_bwd.py", "exec")  # still Python
    assert src.count('"dsa_lap"') == (12 if fine else 10) and "Trace: T.Tensor([NHB * Tq, 16], T.int64)" in src
    assert "*_no_fixed_point(dev), TRACE[0],\n" in src and len(tool.PHASES) == 8
    assert ("Trace[bx, 13] = tr[11]" in src) == fine


def test_indexer_overlap_tool_cuts_equal_work_chunks():
    """The indexer overlap experiment's chunks: contiguous query blocks of about equal score work (key
    blocks), each as wide as its widest block's range; every block in exactly one chunk."""
    import types

    import torch

    tool = _load("ab_indexer_overlap")
    hi = torch.arange(1, 101, dtype=torch.int32)  # causal: block b sees key blocks [0, b + 1)
    plan = types.SimpleNamespace(blk_lo=torch.zeros(100, dtype=torch.int32), blk_hi=hi)
    chunks = tool.equal_work_chunks(plan, 4)
    assert [c[0] for c in chunks] == [0] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == 100
    work = [sum(range(a + 1, b + 1)) for a, b, _w in chunks]
    assert len(chunks) == 4 and max(work) - min(work) <= 100
    assert all(w == b for a, b, w in chunks)  # the widest block of a causal chunk is its last
    assert tool.equal_work_chunks(plan, 1) == [(0, 100, 100)]


def test_backward_ab_patches_apply_to_the_backward_source():
    """The backward's A/B tool (a text-patched copy of the kernel module, and of the contribution reduce where a
    patch changes both, beside the shipped ones) still finds each patch's anchor exactly once, and the patched
    sources are still Python."""
    import dsa_plugins.kernels.sparse_attention_bwd as shipped

    sys.path.insert(0, str(KERNELS))
    try:
        tool = _load("ab_bwd_patch")
    finally:
        sys.path.remove(str(KERNELS))
    assert tool._OLD_IMPORT in Path(shipped.__file__).read_text()  # where a patch of the reduce is swapped in
    for name, parts in tool.PATCHES.items():
        src = tool.patched_sources(name)
        assert src["bwd"] != Path(shipped.__file__).read_text(), name
        assert (src["reduce"] is None) == ("reduce" not in parts), name
        for part, text in src.items():
            if text is not None:
                compile(text, f"ab_{part}_{name}.py", "exec")


def test_trace_patches_apply_to_the_split_topk_source():
    """The split top-k's phase stamps still find their anchors: 9 stamp sites (one in the rounds loop) and the
    trace argument passed by the wrapper."""
    tool = _load("trace_topk_split")
    src = tool.traced_source()
    compile(src, "traced_topk.py", "exec")  # still Python
    assert src.count('T.call_extern(T.int64, "dsa_clock64")') == 9
    assert "Trace: T.Tensor([R * parts, 10], T.int64)" in src and "ties, TRACE[0])" in src
