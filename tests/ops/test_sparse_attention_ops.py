"""Public sparse-attention ops on the reference path: layouts, seed API names, custom ops, compile."""

import pytest
import torch

import dsa_plugins
from dsa_plugins import ops
from dsa_plugins.reference import sparse_attention_dense

from ..helpers import random_indices


def _batched(b=2, s=5, skv=9, h=4, d=16, k=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=dtype)
    kv = torch.randn(b, skv, d, generator=g, dtype=dtype)
    idx = random_indices(b, s, k, skv, generator=g)
    sink = torch.randn(h, generator=g, dtype=torch.float32)
    return q, kv, idx, sink


def test_sparse_attention_batched_and_packed_agree_with_dense():
    q, kv, idx, sink = _batched()
    out, lse = ops.sparse_attention(q, kv, idx, 0.25, sink=sink, dv=12, return_lse=True)
    ref, ref_lse = sparse_attention_dense(q, kv, idx, 0.25, sink.double(), 12)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    # packed layout: batch 0 as THD with kv [Tkv, 1, D] and indices [T, 1, k]
    out_p = ops.sparse_attention(q[0], kv[0].unsqueeze(1), idx[0].unsqueeze(1), 0.25, sink=sink, dv=12)
    torch.testing.assert_close(out_p, ref[0])


def test_seed_api_names_compute_reference_math():
    q, kv, idx, sink = _batched(d=8)
    scale = 8 ** -0.5
    ref, _ = sparse_attention_dense(q, kv, idx, scale, sink.double())
    torch.testing.assert_close(dsa_plugins.sparse_attn_tilelang(q, kv, sink, idx), ref)
    torch.testing.assert_close(dsa_plugins.sparse_attn_tilelang_head_chunked(q, kv, sink, idx, 3), ref)
    torch.testing.assert_close(dsa_plugins.DeepSeekV4SparseAttention.apply(q, kv, sink, idx, None), ref)
    torch.testing.assert_close(dsa_plugins.DeepSeekV4SparseAttentionHeadChunked.apply(q, kv, sink, idx, 1, scale), ref)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "head_chunked"])
def test_v4_functions_hand_back_gradients_in_the_callers_shapes(chunked):
    """DeepSeekV4SparseAttention(.HeadChunked).apply with kv [B, Skv, 1, D] or a packed q [T, H, D]: the output in q's
    shape and each gradient in its input's shape, equal to those of the plain layout."""
    q, kv, idx, sink = _batched(d=8)
    q, kv = q.double(), kv.double()

    def run(q_in, kv_in, idx_in):
        leaves = [q_in.clone().requires_grad_(), kv_in.clone().requires_grad_()]
        fn = dsa_plugins.DeepSeekV4SparseAttentionHeadChunked if chunked else dsa_plugins.DeepSeekV4SparseAttention
        out = fn.apply(leaves[0], leaves[1], sink, idx_in, *((3,) if chunked else ()))
        assert out.shape == q_in.shape
        out.pow(2).sum().backward()
        assert leaves[0].grad.shape == q_in.shape and leaves[1].grad.shape == kv_in.shape
        return out, leaves[0].grad, leaves[1].grad

    out, dq, dkv = run(q, kv, idx)
    out4, dq4, dkv4 = run(q, kv.unsqueeze(2), idx)
    torch.testing.assert_close((out4, dq4, dkv4.squeeze(2)), (out, dq, dkv))
    out_p, dq_p, dkv_p = run(q[0], kv[0], idx[0])  # packed: batch entry 0 alone
    torch.testing.assert_close((out_p, dq_p), (out[0], dq[0]))


@pytest.mark.parametrize("max_heads", [1, 3, 4, 64])
def test_head_chunked_gradients_match_unchunked(max_heads):
    q, kv, idx, sink = _batched(seed=4)
    sink = sink.double()
    dout = torch.randn(*q.shape[:3], q.shape[3], dtype=torch.float64)
    grads = []
    for fn in (
        lambda a, b, c: ops.sparse_attention(a, b, idx, 0.3, sink=c),
        lambda a, b, c: ops.sparse_attention_head_chunked(a, b, idx, 0.3, max_heads, sink=c),
        lambda a, b, c: ops.DeepSeekV4SparseAttentionHeadChunked.apply(a, b, c, idx, max_heads, 0.3),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
        (fn(*leaves) * dout).sum().backward()
        grads.append([t.grad for t in leaves])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b)


def test_sparse_mla_and_tilelang_sparse_attention():
    g = torch.Generator().manual_seed(1)
    t, h, rank, rope, v = 7, 4, 12, 4, 6
    q = torch.randn(t, h, rank + rope, generator=g, dtype=torch.float64)
    kv = torch.randn(t, rank + rope, generator=g, dtype=torch.float64)
    idx = random_indices(1, t, 5, t, generator=g)[0]
    w_vc = torch.randn(h, v, rank, generator=g, dtype=torch.float64)
    out = dsa_plugins.tilelang_sparse_attention(q, kv.unsqueeze(1), idx.unsqueeze(1), w_vc, 0.2)
    latent, _ = sparse_attention_dense(q[None], kv[None], idx[None], 0.2, None, rank)
    expected = torch.einsum("thc,hvc->thv", latent[0], w_vc)
    assert out.shape == (t, h, v)
    torch.testing.assert_close(out, expected)
    # gradients reach q, kv_latent and w_vc
    leaves = [x.clone().requires_grad_() for x in (q, kv, w_vc)]
    ops.sparse_mla(leaves[0], leaves[1], idx, leaves[2], 0.2).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in leaves)


def test_zero_slots_and_empty_batch():
    q, kv, _, _ = _batched()
    out, lse = ops.sparse_attention(q, kv, torch.zeros(2, 5, 0, dtype=torch.int32), 1.0, return_lse=True)
    assert torch.all(out == 0) and torch.isposinf(lse).all()
    out = ops.sparse_attention(q[:, :0], kv, torch.zeros(2, 0, 3, dtype=torch.int32), 1.0)
    assert out.shape == (2, 0, 4, 16)
    # no kv rows at all (Skv 0): every slot is "no key", forward and backward
    leaves = [q.clone().requires_grad_(), kv[:, :0].clone().requires_grad_()]
    out, lse = ops.sparse_attention(*leaves, torch.full((2, 5, 3), -1, dtype=torch.int32), 1.0, return_lse=True)
    assert torch.all(out == 0) and torch.isposinf(lse).all()
    out.sum().backward()
    assert torch.all(leaves[0].grad == 0) and leaves[1].grad.shape == (2, 0, 16)


def test_int64_indices_accepted():
    q, kv, idx, _ = _batched()
    torch.testing.assert_close(ops.sparse_attention(q, kv, idx.long(), 0.5), ops.sparse_attention(q, kv, idx, 0.5))


def test_int64_indices_beyond_int32_are_no_key():
    """2**32 + j and -2**32 must not wrap onto row j / row 0 when converted to int32."""
    q, kv, idx, _ = _batched()
    wide = idx.long()
    wide[..., 0] = 2**32 + 1
    wide[..., 1] = -(2**32)
    narrow = idx.clone()
    narrow[..., :2] = -1
    torch.testing.assert_close(ops.sparse_attention(q, kv, wide, 0.5), ops.sparse_attention(q, kv, narrow, 0.5))


def test_custom_ops_pass_opcheck():
    q, kv, idx, sink = _batched(dtype=torch.float32)
    q.requires_grad_()
    kv.requires_grad_()
    sink = sink.clone().requires_grad_()
    torch.library.opcheck(torch.ops.dsa_plugins.sparse_attention_fwd.default, (q, kv, idx, sink, 0.5, 16, "torch"))
    torch.library.opcheck(torch.ops.dsa_plugins.sparse_attention_fwd.default, (q, kv, idx, None, 0.5, 8, "torch"))


def test_torch_compile_traces_without_graph_breaks():
    q, kv, idx, sink = _batched(dtype=torch.float32)

    def layer(q_, kv_, sink_):
        return ops.sparse_attention(q_ * 2, kv_, idx, 0.5, sink=sink_, backend="torch").sum()

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink)]
    compiled(*leaves).backward()
    leaves_e = [t.clone().requires_grad_() for t in (q, kv, sink)]
    layer(*leaves_e).backward()
    for a, b in zip(leaves, leaves_e):
        torch.testing.assert_close(a.grad, b.grad)


def test_gradcheck_sparse_mla_float64():
    g = torch.Generator().manual_seed(11)
    t, h, rank, rope, v = 5, 2, 4, 2, 3
    q = torch.randn(t, h, rank + rope, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(t, rank + rope, generator=g, dtype=torch.float64, requires_grad=True)
    w_vc = torch.randn(h, v, rank, generator=g, dtype=torch.float64, requires_grad=True)
    idx = random_indices(1, t, 3, t, generator=g)[0]
    assert torch.autograd.gradcheck(lambda a, b, c: ops.sparse_mla(a, b, idx, c, 0.7), (q, kv, w_vc))


def test_packed_varlen_many_short_sequences_matches_per_sequence_batches():
    """THD with causal per-sequence indices (global rows) equals running each sequence alone."""
    g = torch.Generator().manual_seed(12)
    lengths = [1, 2, 1, 5, 3, 1, 8, 2, 1, 4]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    t, h, d, k = int(cu[-1]), 3, 8, 4
    q = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    kv = torch.randn(t, d, generator=g, dtype=torch.float64)
    start, end = ops.causal_key_windows(cu)
    # k random keys inside each query's causal window (global rows), -1 beyond the window size
    r = torch.rand(t, k, generator=g, dtype=torch.float64)
    width = (end - start).long().unsqueeze(1)
    idx = (start.long().unsqueeze(1) + (r * width).long()).to(torch.int32)
    idx = torch.where(torch.arange(k).unsqueeze(0) < width, idx, -1)
    out = ops.sparse_attention(q, kv, idx, 0.4)
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        local = torch.where(idx[a:b] >= 0, idx[a:b] - a, -1)
        ref, _ = sparse_attention_dense(q[None, a:b], kv[None, a:b], local[None], 0.4)
        torch.testing.assert_close(out[a:b], ref[0])


def _fake_kernels(sa, calls):
    """Stand-ins for the kernel wrappers (the reference inside), with their in-place outputs: each
    launch gets contiguous views of one buffer (the forward's out / lse and the backward's dq are
    written, the backward's dkv is added to) and records (direction, batch, queries)."""

    def fake_fwd(q_, kv_, idx_, scale, sink_, dv, *, out, lse, decode):
        calls.append(("fwd", q_.shape[0], q_.shape[1]))
        fake_fwd.decode_flags.append(decode)
        assert q_.shape[0] == kv_.shape[0] == idx_.shape[0] and out.is_contiguous() and lse.is_contiguous()
        o, l = sa.sparse_attention_forward(q_, kv_, idx_, scale, sink_, dv)
        out.copy_(o)
        lse.copy_(l)
        return out, lse

    def fake_bwd(q_, kv_, idx_, out_, lse_, dout_, scale, sink_, dv, deterministic=False, *, dq, dkv):
        calls.append(("bwd", q_.shape[0], q_.shape[1]))
        assert dq.is_contiguous() and dkv.is_contiguous() and dkv.shape == kv_.shape
        dq_, dkv_, dsink = sa.sparse_attention_backward(q_, kv_, idx_, out_, lse_, dout_, scale, sink_, dv)
        dq.copy_(dq_)
        dkv.add_(dkv_)
        return dq, dkv, dsink

    fake_fwd.decode_flags = []
    return fake_fwd, fake_bwd


def _run_in_chunks(monkeypatch, inputs, max_elements, bwd_calls=None):
    """Forward and backward of ``inputs`` (q, kv, idx, sink) through the fake kernels with the
    int32 bound at ``max_elements``: outputs and gradients must equal the dense reference. Returns
    the forward launches (direction, batch, queries); ``bwd_calls`` (a list) receives the backward's."""
    import importlib

    sa = importlib.import_module("dsa_plugins.ops.attention_custom_ops")
    q, kv, idx, sink = inputs
    calls = []
    fake_fwd, fake_bwd = _fake_kernels(sa, calls)
    monkeypatch.setattr(sa, "choose_kernel", lambda *a, **k: True)
    monkeypatch.setattr(sa, "load_kernel", lambda name: fake_fwd if name.endswith("fwd") else fake_bwd)
    monkeypatch.setattr(sa, "_MAX_KERNEL_ELEMENTS", max_elements)
    leaves = [t.clone().requires_grad_() for t in (q, kv, sink.double())]
    out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.3, sink=leaves[2])
    fwd_calls = list(calls)
    # the decode splits follow the whole input (one query row), never a one-row block of a longer one
    whole_s = q.shape[1] if q.dim() == 4 else q.shape[0]
    assert fake_fwd.decode_flags and all(f == (whole_s == 1) for f in fake_fwd.decode_flags)
    ref_leaves = [t.clone().requires_grad_() for t in (q, kv, sink.double())]
    ref, _ = sparse_attention_dense(ref_leaves[0], ref_leaves[1], idx, 0.3, ref_leaves[2])
    torch.testing.assert_close(out, ref)
    dout = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, leaves, dout), torch.autograd.grad(ref, ref_leaves, dout)):
        torch.testing.assert_close(a, b)
    if bwd_calls is not None:
        bwd_calls += calls[len(fwd_calls):]
    return fwd_calls


def test_query_chunking_for_int32_kernels_is_exact(monkeypatch):
    """Inputs over the kernels' int32 range run in query chunks; the split must not change results."""
    # four query-entries per chunk: the whole batch does not fit two queries' worth, so the
    # queries split one batch entry at a time (contiguous slices, written in place)
    fwd_calls = _run_in_chunks(monkeypatch, _batched(b=2, s=9, h=4, d=16, k=6, seed=8), 4 * (6 + 128))
    assert fwd_calls == [("fwd", 1, 4), ("fwd", 1, 4), ("fwd", 1, 1)] * 2


def test_generation_steps_reach_the_kernel_as_decode_rows(monkeypatch):
    """One query row per sequence (a generation step) is passed on as decode rows (the kernel's batch-invariant
    split), over caches past the int32 range in one launch (the forward addresses kv in 64 bits); the one-row
    tail block of a longer input above is not."""
    fwd_calls = _run_in_chunks(monkeypatch, _batched(b=3, s=1, skv=40, h=4, d=16, k=6, seed=10), 2 * 40 * 16 + 20)
    assert [c[1:] for c in fwd_calls] == [(3, 1)]


def test_generation_steps_of_many_sequences_run_in_blocks_of_whole_entries(monkeypatch):
    """A generation step whose q / out / indices pass the bound (tens of thousands of sequences) runs in blocks of
    whole entries, each still decode rows, in the forward and the backward."""
    bwd_calls = []
    # one query of one entry: max(4 x 16, 6 + 128) = 134 elements; two entries per block
    fwd_calls = _run_in_chunks(monkeypatch, _batched(b=5, s=1, skv=40, h=4, d=16, k=6, seed=12), 2 * 134 + 10,
                               bwd_calls)
    assert fwd_calls == [("fwd", 2, 1), ("fwd", 2, 1), ("fwd", 1, 1)]
    assert [c for c in bwd_calls if c[0] == "bwd"] == [("bwd", 1, 1)] * 5  # the backward's caches: one entry each


def test_batch_chunking_for_int32_kernels_is_exact(monkeypatch):
    """Caches over the backward kernel's int32 range (B 32 x 128K tokens x 576) run its launches in batch
    chunks, each with its own cache slice (the forward takes them whole); the split must not change outputs or
    gradients (dkv parts accumulated into views of one buffer)."""
    inputs = _batched(b=3, s=4, skv=40, h=4, d=16, k=6, seed=9)
    bwd_calls = []
    # two caches of 40 x 16 per chunk; the whole batch's queries (3 x 4 x (6 + 128)) within the bound
    fwd_calls = _run_in_chunks(monkeypatch, inputs, 2 * 40 * 16 + 400, bwd_calls)
    assert fwd_calls == [("fwd", 3, 4)]
    assert bwd_calls == [("bwd", 2, 4), ("bwd", 1, 4)]


def test_autocast_runs_the_ops_in_its_dtype(monkeypatch):
    """Inside torch.autocast (fp32 weights, bf16 mixed precision: accelerate, HF Trainer) float32 inputs reach
    the ops in the autocast dtype, as with SDPA, so the kernels (bf16 / fp16 only) serve them; gradients go back
    to the float32 leaves; outside a region float32 stays float32."""
    import importlib

    attention_module = importlib.import_module("dsa_plugins.ops.sparse_attention")  # the package exports the op
    seen = []
    real = attention_module.normalise_inputs
    monkeypatch.setattr(attention_module, "normalise_inputs", lambda q, kv, *a: seen.append((q.dtype, kv.dtype))
                        or real(q, kv, *a))
    q, kv, idx, sink = _batched(dtype=torch.float32)
    leaves = [x.clone().requires_grad_() for x in (q, kv)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.25, sink=sink, dv=12)
    want = ops.sparse_attention(q.bfloat16(), kv.bfloat16(), idx, 0.25, sink=sink, dv=12)
    assert seen[0] == (torch.bfloat16, torch.bfloat16) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)  # the reference's bf16 matmuls
    out.float().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 and x.grad.abs().sum() > 0 for x in leaves)
    seen.clear()
    assert ops.sparse_attention(q, kv, idx, 0.25, sink=sink, dv=12).dtype == torch.float32
    assert seen == [(torch.float32, torch.float32)]
    # absorbed MLA: q, the latent and w_vc all in the autocast dtype
    w_vc = torch.randn(q.shape[2], 5, 12)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mla = ops.sparse_mla(q, kv, idx, w_vc, 0.25)
    assert mla.dtype == torch.bfloat16 and seen == [(torch.bfloat16, torch.bfloat16)]
    # the indexer's scores and the fused loss's inputs follow the same rule (weights stay float32)
    iq, ik, w = torch.randn(5, 4, 16), torch.randn(9, 16), torch.rand(5, 4)
    ends = torch.arange(1, 6, dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sel = ops.indexer_topk(iq, ik, w, 3, torch.zeros_like(ends), ends)
        loss = ops.FusedIndexerLoss(iq, ik, w)
    assert sel.shape == (5, 3)
    assert loss.index_q.dtype == loss.index_k.dtype == torch.bfloat16 and loss.weights.dtype == torch.float32


def test_autocast_cast_leaves_validation_to_the_ops():
    """The autocast cast runs before the ops' checks: a non-tensor input still gets the op's own message, and
    tensors of a device type without autocast (meta) pass through untouched."""
    from dsa_plugins.ops.backend import autocast_floats

    with pytest.raises(ValueError, match="q must be a torch.Tensor"):
        ops.sparse_attention([1.0], torch.zeros(2, 4), torch.zeros(1, 2, dtype=torch.int32), 0.25)
    q, kv = torch.zeros(1, 2, 4, device="meta"), torch.zeros(2, 4, device="meta")
    assert all(a is b for a, b in zip(autocast_floats(q, None, kv), (q, None, kv)))
