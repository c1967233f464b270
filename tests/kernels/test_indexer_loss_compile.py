"""CPU test: every shipped configuration of the sparse indexer KL loss kernels compiles for sm_90a,
and the wrapper rejects bad inputs with a message that names the tensor (no GPU needed)."""

import importlib.util
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dsa_plugins.kernels import indexer_loss as mod

SM90A = {"kind": "cuda", "arch": "sm_90a"}
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def _cfg_id(cfg):
    if cfg["kind"] == "dense_terms":
        return f"dense_terms-grads{int(cfg['grads'])}"
    if cfg["kind"] in ("dense_target", "dense_norm"):
        return f"{cfg['kind']}-h{cfg['heads']}-d{cfg['dim']}-{cfg['block_q']}x{cfg['block_k']}"
    extra = f"-lse{int(cfg['lse_pass'])}" if "lse_pass" in cfg else f"-h{cfg['heads']}-grads{int(cfg['grads'])}"
    return f"{cfg['kind']}-d{cfg['dim']}{extra}" + ("-det" if cfg.get("det") else "") + (
        "-lsegiven" if cfg.get("lse_given") else "")


def test_module_imports_without_tilelang_side_effects():
    assert callable(mod.indexer_kl_loss_sparse) and callable(mod.indexer_kl_loss_from_probs)
    keys = {mod._normalise(c) for c in mod.SHIPPED_CONFIGS}
    assert len(keys) == len(mod.SHIPPED_CONFIGS), "SHIPPED_CONFIGS has duplicates"
    kinds = {c["kind"] for c in mod.SHIPPED_CONFIGS}
    assert kinds == {"attn_probs", "dense_target", "dense_norm", "loss", "dense_terms"}
    assert {c["grads"] for c in mod.SHIPPED_CONFIGS if c["kind"] == "loss"} == {True, False}
    # both attention families (absorbed MLA 576, V4 512) with and without the in-kernel lse pass
    shapes = {(c["dim"], c["lse_pass"]) for c in mod.SHIPPED_CONFIGS if c["kind"] == "attn_probs"}
    assert shapes == {(576, False), (576, True), (512, False), (512, True)}
    # the dense target and normaliser in the tiles of the dense loss's logits, for the models' head counts
    # and both dims
    from dsa_plugins.kernels import indexer

    plans = {(cfg["block_q"], cfg["block_k"]) for cfg in (indexer.default_config(mod.dense_index_heads(h), 128,
                                                                                 tiled=True) for h in (8, 32, 64))}
    for kind in ("dense_target", "dense_norm"):
        assert {(c["block_q"], c["block_k"]) for c in mod.SHIPPED_CONFIGS if c["kind"] == kind} == plans
        assert {(c["heads"], c["dim"]) for c in mod.SHIPPED_CONFIGS if c["kind"] == kind} == {
            (64, 576), (128, 576), (64, 512), (128, 512)}
    assert {c["grads"] for c in mod.SHIPPED_CONFIGS if c["kind"] == "dense_terms"} == {True, False}


def test_unsupported_reason():
    assert mod.unsupported_reason(64, 576, 64, 128, torch.bfloat16) is None
    assert mod.unsupported_reason(128, 576, 32, 128, torch.bfloat16) is None
    assert mod.unsupported_reason(16, 512, 64, 128) is None
    assert "bfloat16" in mod.unsupported_reason(64, 576, 64, 128, torch.float32)
    assert "Dqk" in mod.unsupported_reason(64, 600, 64, 128, torch.bfloat16)
    assert "index heads" in mod.unsupported_reason(64, 576, 256, 128, torch.bfloat16)
    assert "index head dim" in mod.unsupported_reason(64, 576, 64, 100, torch.bfloat16)


def test_config_validation():
    with pytest.raises(ValueError, match="kind"):
        mod._normalise({"kind": "nope", "dim": 576})
    with pytest.raises(ValueError, match="dim"):
        mod._normalise({"kind": "attn_probs", "dim": 570, "lse_pass": False})
    with pytest.raises(ValueError, match="heads"):
        mod._normalise({"kind": "loss", "heads": 48, "dim": 128, "grads": True})
    with pytest.raises(ValueError, match="needs 'grads'"):
        mod._normalise({"kind": "loss", "heads": 64, "dim": 128})
    with pytest.raises(ValueError, match="heads"):
        mod._normalise({"kind": "dense_target", "heads": 48, "dim": 576, "block_q": 4, "block_k": 128})
    with pytest.raises(ValueError, match="block_q"):
        mod._normalise({"kind": "dense_target", "heads": 64, "dim": 576})
    with pytest.raises(ValueError, match="block_k must be 64 or 128"):
        mod._dense_target_program(64, 576, 4, 256)
    with pytest.raises(ValueError, match="heads"):
        mod._dense_norm_program(48, 576, 4, 128)
    assert [mod.dense_target_heads(h) for h in (1, 16, 17, 40, 64, 65, 128, 192)] == [16, 16, 32, 64, 64, 128, 128,
                                                                                        128]
    with pytest.raises(ValueError, match="det.*needs grads"):
        mod._normalise({"kind": "loss", "heads": 64, "dim": 128, "grads": False, "det": True})
    # det is optional (off): an older config names the same program
    assert mod._normalise({"kind": "loss", "heads": 64, "dim": 128, "grads": True}) == \
        mod._normalise({"kind": "loss", "heads": 64, "dim": 128, "grads": True, "det": False})
    # float/bool noise normalises to one key
    a = mod._normalise({"kind": "attn_probs", "dim": 576, "lse_pass": 1})
    b = mod._normalise({"kind": "attn_probs", "dim": 576.0, "lse_pass": True, "unused": 1})
    assert a == b


@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_attn_probs_layout_for_every_accepted_dim():
    """Every Dqk the loss accepts (multiples of 64 up to 576) gets a program: "chunked" for the model dims 576
    and 512 with attn_lse given, "sync" otherwise (dims 64, 320, 448 have no stage count that divides their
    64-column chunks); asking "chunked" for such a dim is a clear error, not a StopIteration."""
    for dim in range(64, 577, 64):
        for lse_pass in (False, True):
            mod._attn_probs_program(dim, lse_pass)  # builds the TIR (no compile)
    for dim in (64, 320, 448):
        with pytest.raises(ValueError, match="multiple of its stages"):
            mod._attn_probs_program(dim, False, gather="chunked")


def _inputs(**over):
    t, tk, h, hi = 3, 5, 16, 32
    d = {
        "index_q": torch.zeros(t, hi, 128, dtype=torch.bfloat16),
        "index_k": torch.zeros(tk, 128, dtype=torch.bfloat16),
        "weights": torch.zeros(t, hi),
        "q": torch.zeros(t, h, 576, dtype=torch.bfloat16),
        "kv": torch.zeros(tk, 576, dtype=torch.bfloat16),
        "attn_lse": None,
        "topk_indices": torch.zeros(t, 4, dtype=torch.int32),
        "scale": 0.1,
    }
    d.update(over)
    return d


@pytest.mark.parametrize(
    "over, match",
    [
        ({}, "index_q must be bfloat16 on a CUDA device"),  # CPU tensors
        ({"index_q": torch.zeros(3, 32, 128)}, "index_q must be bfloat16"),
        ({"index_q": torch.zeros(3, 32, dtype=torch.bfloat16)}, "index_q"),
    ],
)
def test_wrapper_rejects_bad_inputs(over, match):
    with pytest.raises(ValueError, match=match):
        mod.indexer_kl_loss_sparse(**_inputs(**over))


@pytest.fixture(scope="module")
def compiled():
    """Every shipped program compiled for sm_90a (nvcc runs in parallel subprocesses); an entry
    holds the exception if that configuration failed."""
    if not HAS_TILELANG:
        pytest.skip("TileLang is not installed")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")

    def build(cfg):
        try:
            return mod.build_config(cfg, target=SM90A).get_kernel_source()
        except Exception as exc:  # noqa: BLE001 (reported by the test of that configuration)
            return exc

    with ThreadPoolExecutor(max(1, min(len(mod.SHIPPED_CONFIGS), os.cpu_count() or 1))) as ex:
        return list(ex.map(build, mod.SHIPPED_CONFIGS))


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(mod.SHIPPED_CONFIGS)), ids=[_cfg_id(c) for c in mod.SHIPPED_CONFIGS])
def test_shipped_config_compiles_for_sm90a(compiled, i, caplog):
    src = compiled[i]
    if isinstance(src, Exception):
        raise src
    cfg = mod.SHIPPED_CONFIGS[i]
    if cfg["kind"] == "dense_terms":  # the row program: two passes over a row, block reductions, no MMA
        assert "rows" in src and "width" in src and "__syncthreads" in src
        # dI is written over I only with the gradients
        assert bool(re.search(r"\bI\[[^;]*\] = ", src)) == cfg["grads"]
        return
    assert "wgmma" in src  # the GEMMs run on Hopper tensor cores
    if cfg["kind"] in ("dense_target", "dense_norm"):
        # contiguous keys: TMA loads of both operands by a producer warpgroup beside two consumer warpgroups,
        # 4 stages; the target: keys as MMA rows, 256 (rows, heads) columns, its tiles stored by TMA; the
        # normaliser: (rows, heads) as MMA rows (its running max and sum inside a quad)
        assert "tma_load(KV_desc" in src and "tma_load(Q_desc" in src
        assert "__launch_bounds__(384" in src and "warpgroup_reg_alloc" in src and "mbarrier[7]" in src
        if cfg["kind"] == "dense_target":
            assert "tma_store(P_desc" in src and "64, 256, 16" in src
        else:
            assert "64, 128, 16" in src and "AllReduce<tl::MaxOp, 4" in src and "Norm2[" in src
        for name in ("nq", "nqb") + (("width",) if cfg["kind"] == "dense_target" else ()):  # (the key count lives in the TMA descriptor)
            assert re.search(rf"\bint {name}\b", src), f"{name} is not a runtime parameter"
        assert "cp_async" not in src
        return
    assert "cp_async" in src or "cp.async" in src  # gathered rows land through predicated async copies
    for name in ("n_rows", "n_keys", "slot_steps"):
        assert name in src, f"{name} is not a runtime parameter"
    if cfg["kind"] == "attn_probs" and not cfg["lse_pass"]:
        # attn_lse given: slots as MMA rows, the gathered rows in 64-column chunks through 3 cp.async buffers
        # (576: 9 chunks a block) or 4 (512: 8 chunks), the next ones in flight while one is multiplied
        stages = 3 if cfg["dim"] == 576 else 4
        assert f"cp_async_wait<{stages - 1}>" in src
        # one commit group per chunk: the prologue's stages - 1, then a block's dim / 64
        assert src.count("tl::cp_async_commit()") == stages - 1 + cfg["dim"] // 64
    if cfg["kind"] == "loss":
        # d_index_k scatter only with the gradients; the deterministic program stores contribution rows instead
        assert ("AtomicAdd" in src) == (cfg["grads"] and not cfg.get("det", False))
        assert ("n_contrib" in src) == cfg.get("det", False)
    # a second request is served from the cache, without compiling (nor logging) again
    with caplog.at_level(logging.INFO, logger="dsa_plugins"):
        again = mod.build_config(dict(cfg), target=SM90A)
    assert again.get_kernel_source() == src
    assert not [r for r in caplog.records if "compiled TileLang indexer_loss" in r.getMessage()]
