"""Backend selection rules and every validation error path."""

import logging

import pytest
import torch

from dsa_plugins import ops
from dsa_plugins.kernels import kernel_unavailable_reason


def _inputs(dtype=torch.float32):
    q = torch.randn(1, 3, 2, 8, dtype=dtype)
    kv = torch.randn(1, 5, 8, dtype=dtype)
    idx = torch.tensor([[[0, 1], [2, -1], [4, 3]]], dtype=torch.int32)
    return q, kv, idx


def test_forced_tilelang_without_gpu_raises_clear_error():
    q, kv, idx = _inputs(torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='tilelang' was requested for sparse_attention_fwd.*CUDA"):
        ops.sparse_attention(q, kv, idx, 0.5, backend="tilelang")
    with pytest.raises(RuntimeError, match="backend='tilelang'"):
        ops.should_use_tilelang("tilelang", True, "sparse_attention", [q])


def test_auto_falls_back_with_one_warning(caplog):
    q, kv, idx = _inputs()
    with caplog.at_level(logging.WARNING, logger="dsa_plugins"):
        ops.sparse_attention(q, kv, idx, 0.5)
        ops.sparse_attention(q, kv, idx, 0.5)
    msgs = [r.getMessage() for r in caplog.records if "torch reference path" in r.getMessage()]
    assert len(msgs) == 1 and "sparse_attention_fwd" in msgs[0]


def test_torch_backend_never_warns(caplog, monkeypatch):
    q, kv, idx = _inputs()
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "torch")
    with caplog.at_level(logging.WARNING, logger="dsa_plugins"):
        ops.sparse_attention(q, kv, idx, 0.5)
    assert not caplog.records


def test_env_backend_validated(monkeypatch):
    q, kv, idx = _inputs()
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="DSA_PLUGINS_BACKEND must be one of"):
        ops.sparse_attention(q, kv, idx, 0.5)
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.sparse_attention(q, kv, idx, 0.5, backend="triton")


def test_should_use_tilelang_contract():
    q, _, _ = _inputs(torch.bfloat16)
    assert ops.should_use_tilelang("torch", True, "sparse_attention", [q]) is False
    assert ops.should_use_tilelang("auto", True, "sparse_attention", [q]) is False  # CPU tensors
    assert ops.should_use_tilelang("auto", False, "indexer", [q]) is False
    with pytest.raises(RuntimeError, match="not available"):
        ops.should_use_tilelang("tilelang", False, "indexer", [q])
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="bfloat16"):
            ops.should_use_tilelang("tilelang", True, "my_op", [q.float().cuda()], require_bf16=True)


def test_is_dsa_kernel_available_names():
    assert ops.is_dsa_kernel_available("sparse_attention") in (True, False)
    if not torch.cuda.is_available():
        assert ops.is_dsa_kernel_available("indexer") is False
    with pytest.raises(ValueError, match="unknown DSA kernel"):
        ops.is_dsa_kernel_available("flash")
    assert kernel_unavailable_reason("sparse_attention", (torch.zeros(1),)) is not None


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, kv, idx: (q.double(), kv, idx), "kv must have the dtype of q"),
        (lambda q, kv, idx: (q.int(), kv, idx), r"q must have dtype in"),
        (lambda q, kv, idx: (q[0, 0], kv, idx), "q must have 3 or 4 dimensions"),
        (lambda q, kv, idx: (q, kv[:, :, :4], idx), r"kv must be \[1, Skv, 8\]"),
        (lambda q, kv, idx: (q, kv.expand(2, -1, -1), idx), r"kv must be \[1, Skv, 8\]"),
        (lambda q, kv, idx: (q, kv, idx.float()), "indices must have dtype in"),
        (lambda q, kv, idx: (q, kv, idx[:, :2]), r"indices must be \[1, 3, K\]"),
        (lambda q, kv, idx: (q, kv, idx.transpose(1, 2).contiguous().transpose(1, 2)), "indices must be contiguous in its last dimension"),
        (lambda q, kv, idx: (q.transpose(2, 3), kv, idx), "q must be contiguous in its last dimension"),
        (lambda q, kv, idx: (q, kv.unsqueeze(2).expand(-1, -1, 2, -1), idx), "kv must have size 1 in dimension 2"),
        (lambda q, kv, idx: (q, [1.0], idx), "kv must be a torch.Tensor"),
    ],
)
def test_validation_errors_name_the_tensor(mutate, message):
    q, kv, idx = mutate(*_inputs())
    with pytest.raises(ValueError, match=message):
        ops.sparse_attention(q, kv, idx, 0.5)


def test_scale_sink_dv_validation():
    q, kv, idx = _inputs()
    for bad in (0.0, -1.0, float("nan"), float("inf"), "x", torch.tensor(0.5)):
        with pytest.raises(ValueError, match="scale must be"):
            ops.sparse_attention(q, kv, idx, bad)
    with pytest.raises(ValueError, match=r"sink must have size 2 in dimension 0"):
        ops.sparse_attention(q, kv, idx, 0.5, sink=torch.zeros(3))
    with pytest.raises(ValueError, match=r"dv must be in \[1, 8\]"):
        ops.sparse_attention(q, kv, idx, 0.5, dv=9)
    with pytest.raises(ValueError, match=r"w_vc must be \[H=2"):
        ops.sparse_mla(q, kv, idx, torch.zeros(3, 4, 8), 0.5)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="kv must be on"):
            ops.sparse_attention(q, kv.cuda(), idx, 0.5)


def test_index_range_check_is_opt_in(monkeypatch):
    q, kv, idx = _inputs()
    idx[0, 1, 1] = 5  # == Skv: invalid, treated as no key by default
    out = ops.sparse_attention(q, kv, idx, 0.5)
    assert torch.isfinite(out).all()
    monkeypatch.setenv("DSA_PLUGINS_CHECK_INDICES", "1")
    with pytest.raises(ValueError, match=r"indices has 1 entries outside \[-1, 5\) \(first at position \(0, 1, 1\): 5\)"):
        ops.sparse_attention(q, kv, idx, 0.5)


def test_indexer_validation():
    iq, ik, w = torch.randn(4, 2, 8).bfloat16(), torch.randn(6, 8).bfloat16(), torch.rand(4, 2)
    s, e = torch.zeros(4, dtype=torch.int32), torch.full((4,), 6, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"index_k must have size 8 in dimension 1"):
        ops.indexer_topk(iq, ik[:, :4], w, 2, s, e)
    with pytest.raises(ValueError, match=r"weights must have size 2 in dimension 1"):
        ops.indexer_topk(iq, ik, w[:, :1], 2, s, e)
    with pytest.raises(ValueError, match=r"key_end must have size 4"):
        ops.indexer_topk(iq, ik, w, 2, s, e[:3])
    with pytest.raises(ValueError, match="topk must be >= 1"):
        ops.indexer_topk(iq, ik, w, 0, s, e)
    with pytest.raises(ValueError, match="pass query_indices"):
        ops.tilelang_indexer_topk(iq, ik, w, torch.tensor([0, 6]), 2)
