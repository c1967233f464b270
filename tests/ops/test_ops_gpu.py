"""The public ops through the TileLang kernels (backend="tilelang" and "auto") against the torch
reference in fp32, on fresh random inputs. Skipped without a CUDA GPU."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import dsa_plugins
from dsa_plugins import ops
from dsa_plugins.reference import sparse_attention_dense

from ..helpers import random_indices, rel_err

pytestmark = pytest.mark.gpu

# (b, s, skv, h, dqk, dv, k, sink): the model shapes and awkward ones
SHAPES = [
    (1, 64, 128, 64, 512, 512, 100, True),     # DeepSeek-V4, k not a multiple of the block
    (2, 33, 77, 128, 512, 512, 64, True),
    (1, 48, 256, 64, 576, 512, 256, False),    # absorbed MLA (GLM-5 heads)
    (1, 17, 300, 128, 576, 512, 2048 + 5, False),  # V3.2 heads, k > Skv
    (2, 5, 40, 16, 576, 512, 7, False),         # TP shards / small models
    (1, 3, 9, 32, 512, 512, 1, True),
]


def _fresh(b, s, skv, h, dqk, k, sink, device="cuda"):
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q = torch.randn(b, s, h, dqk, generator=g).to(device, torch.bfloat16)
    kv = torch.randn(b, skv, dqk, generator=g).to(device, torch.bfloat16)
    idx = random_indices(b, s, k, skv, generator=g).to(device)
    z = (torch.randn(h, generator=g) * 2).to(device) if sink else None
    return q, kv, idx, z


@pytest.mark.parametrize("shape", SHAPES)
def test_sparse_attention_kernel_matches_reference(shape):
    b, s, skv, h, dqk, dv, k, sink = shape
    q, kv, idx, z = _fresh(b, s, skv, h, dqk, k, sink)
    scale = dqk ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, kv) + ((z,) if sink else ())]
    out, lse = ops.sparse_attention(leaves[0], leaves[1], idx, scale, sink=leaves[2] if sink else None, dv=dv,
                                    backend="tilelang", return_lse=True)
    ref_leaves = [t.detach().double().clone().requires_grad_() for t in leaves]
    ref, ref_lse = sparse_attention_dense(ref_leaves[0], ref_leaves[1], idx, scale, ref_leaves[2] if sink else None, dv)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out.float(), ref) < 1e-2
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), ~finite)
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 2e-2
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, a, bb in zip(("dq", "dkv", "dsink"), got, want):
        assert torch.isfinite(a.float()).all(), name
        assert rel_err(a.float(), bb) < 2e-2, name


def test_auto_picks_kernels_on_hopper_bf16():
    q, kv, idx, z = _fresh(1, 8, 32, 64, 512, 16, True)
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("auto picks kernels on Hopper only")
    assert ops.is_dsa_kernel_available("sparse_attention")
    assert ops.should_use_tilelang("auto", True, "sparse_attention", [q, kv])
    torch.testing.assert_close(ops.sparse_attention(q, kv, idx, 0.1, sink=z),
                               ops.sparse_attention(q, kv, idx, 0.1, sink=z, backend="tilelang"))


@pytest.mark.parametrize("max_heads", [16, 32, 64])
def test_head_chunked_matches_unchunked_on_gpu(max_heads):
    q, kv, idx, z = _fresh(1, 40, 96, 128, 512, 64, True)
    leaves = [t.clone().requires_grad_() for t in (q, kv, z)]
    leaves_c = [t.clone().requires_grad_() for t in (q, kv, z)]
    out = ops.sparse_attn_tilelang(*leaves[:3], idx)
    out_c = ops.sparse_attn_tilelang_head_chunked(*leaves_c[:3], idx, max_heads)
    assert rel_err(out_c.float(), out.float()) < 1e-3
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, leaves, dout)
    g_c = torch.autograd.grad(out_c, leaves_c, dout)
    for a, b in zip(g_c, g):
        assert rel_err(a.float(), b.float()) < 1e-2


@pytest.mark.parametrize("h", (64, 128))
def test_decode_over_caches_past_2_31_elements_is_one_launch(h, monkeypatch):
    """A generation step over caches of 2**31 elements or more (B 2 x 3.73M x 576 here; B 32 x 128K x 576 in a
    model): one forward launch whose gathers for the second sequence lie past element 2**31, the float64
    reference's values (rows gathered first, so the reference never holds the cache in float64)."""
    import importlib

    from dsa_plugins.reference.sparse_attention import sparse_attention_forward

    sa = importlib.import_module("dsa_plugins.ops.attention_custom_ops")
    b, d, dv, k = 2, 576, 512, 2048
    t = 2**31 // d + 4099  # the second sequence starts past element 2**31
    g = torch.Generator(device="cuda").manual_seed(h)
    kv = torch.randn(b, t, d, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(b, 1, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    idx = torch.randint(t - 60000, t, (b, 1, k), device="cuda", generator=g, dtype=torch.int32)
    idx[..., ::7] = -1
    idx[0, 0, :300] = torch.randint(0, 5000, (300,), device="cuda", generator=g, dtype=torch.int32)
    launches = []
    real_load = sa.load_kernel

    def counted_load(name):
        kernel = real_load(name)
        return lambda *a, **kw: (launches.append(name), kernel(*a, **kw))[1]

    monkeypatch.setattr(sa, "load_kernel", counted_load)
    out = ops.sparse_attention(q, kv, idx, 0.04, dv=dv, backend="tilelang")
    assert launches == ["sparse_attention_fwd"]
    rows = kv[torch.arange(b, device="cuda")[:, None], idx[:, 0].clamp(min=0).long()]  # [b, k, d]
    local = torch.arange(k, device="cuda", dtype=torch.int32).expand(b, 1, k).masked_fill(idx < 0, -1)
    ref, _ = sparse_attention_forward(q.double(), rows.double(), local, 0.04, None, dv)
    assert torch.isfinite(out).all()
    assert rel_err(out.double(), ref) < 1e-2


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_int32_chunking_writes_one_buffer_and_matches_one_launch(monkeypatch, deterministic):
    """Inputs past the kernels' int32 range run in blocks (batch entries, then queries) that write
    views of one output buffer: the same outputs and gradients as one launch, bitwise reproducible
    in deterministic mode."""
    import importlib

    sa = importlib.import_module("dsa_plugins.ops.attention_custom_ops")
    if deterministic:
        monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "1")
    q, kv, idx, z = _fresh(2, 300, 257, 64, 576, 2048 + 5, False)
    dout = torch.randn(2, 300, 64, 512, device="cuda").bfloat16()

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, kv)]
        out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.04, dv=512, backend="tilelang")
        return (out, *torch.autograd.grad(out, leaves, dout))

    whole = run()
    per_query = 64 * 576
    monkeypatch.setattr(sa, "_MAX_KERNEL_ELEMENTS", 70 * per_query)  # blocks of 70 queries, one entry each
    assert len(sa._kernel_chunks(q, kv, idx, 512)) == 2 * 5
    blocks = run()
    out, dq, dkv = blocks
    assert not any(torch.isnan(t).any() for t in blocks)
    assert torch.equal(out, whole[0]) and torch.equal(dq, whole[1])  # each query row is computed alone
    # the blocks add dkv's fp32 sums in another order, so the bf16 results may differ by a rounding
    # step (measured on an H100: 8.4e-5 relative in norm, 0.031 = one step at 4.0 elementwise);
    # a missing or doubled block would be O(1) in norm
    a, b = dkv.float(), whole[2].float()
    step = torch.maximum(a.abs(), b.abs()) * 2.0**-6 + 1e-3 * b.abs().max()  # two bf16 steps, or fp32 noise
    assert ((a - b).abs() <= step).all(), f"max difference {(a - b).abs().max().item():.3e}"
    assert rel_err(a, b) < 1e-3
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(run(), blocks))


def test_tilelang_sparse_attention_mla_packed():
    t, h, v = 200, 64, 256
    q, kv, idx, _ = _fresh(1, t, t, h, 576, 2048, False)
    w_vc = (torch.randn(h, v, 512, device="cuda") * 0.05).bfloat16()
    out = ops.tilelang_sparse_attention(q[0], kv[0].unsqueeze(1), idx[0].unsqueeze(1), w_vc, 0.04)
    ref = ops.tilelang_sparse_attention(q[0].double(), kv[0].double().unsqueeze(1), idx[0].unsqueeze(1), w_vc.double(), 0.04)
    assert out.shape == (t, h, v) and rel_err(out.float(), ref) < 1e-2


def test_deterministic_mode_is_bitwise_stable(monkeypatch):
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "1")
    q, kv, idx, z = _fresh(1, 256, 64, 64, 576, 512, False)  # many queries share few keys
    dout = torch.randn(1, 256, 64, 512, device="cuda").bfloat16()
    first = None
    for _ in range(20):
        leaves = [t.clone().requires_grad_() for t in (q, kv)]
        out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.04, dv=512, backend="tilelang")
        grads = torch.autograd.grad(out, leaves, dout)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(grads, first))


def test_torch_path_gradients_are_the_same_bits_every_run_on_cuda():
    """backend="torch" on a GPU (the reference, also what "auto" falls back to): dkv and d_index_k are sums over
    the slots naming a row; with index_add_'s atomics their bits changed from run to run. Many queries share few
    keys here (hundreds of contributions per row), so an order that follows the timing shows."""
    t, h, hi, di = 256, 16, 8, 64
    q, kv, idx, _ = _fresh(1, t, 48, h, 576, 40, False)
    idx = torch.where((idx >= 0) & (idx < 48), idx, -1)  # the loss's rows: -1 or a key
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    iq = torch.randn(t, hi, di, generator=g).cuda()
    ik = torch.randn(48, di, generator=g).cuda()
    w = (torch.randn(t, hi, generator=g) * 0.1).cuda()
    dout = torch.randn(1, t, h, 512, device="cuda")
    q, kv = q.float(), kv.float()
    first = None
    for _ in range(8):
        leaves = [x.clone().requires_grad_() for x in (q, kv, iq, ik, w)]
        out, lse = ops.sparse_attention(leaves[0], leaves[1], idx, 0.04, dv=512, backend="torch", return_lse=True)
        loss = ops.indexer_kl_loss(leaves[2], leaves[3], leaves[4], q[0], kv[0], lse[0].detach(), 0.04,
                                   topk_indices=idx[0], backend="torch")
        grads = torch.autograd.grad((out.float() * dout).sum() + loss, leaves)
        assert all(torch.isfinite(x).all() for x in grads)
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(grads, first))


def test_deterministic_mode_covers_the_fused_indexer_loss():
    """Inside dsa_plugins.deterministic(): the attention + fused indexer loss step gives bitwise equal
    gradients over repeats, index_k's included (its d_index_k summed in a fixed order), and the same loss value."""
    t, h, hi, di = 256, 64, 32, 128
    q, kv, idx, _ = _fresh(1, t, 64, h, 576, 512, False)  # many queries share few keys
    g = torch.Generator().manual_seed(3)
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(64, di, generator=g).cuda().bfloat16()
    w = (torch.randn(t, hi, generator=g) * 0.02).cuda()
    dout = torch.randn(1, t, h, 512, device="cuda").bfloat16()
    first = None
    for _ in range(10):
        leaves = [x.clone().requires_grad_() for x in (q, kv, iq, ik, w)]
        with dsa_plugins.deterministic():
            loss = ops.FusedIndexerLoss(leaves[2], leaves[3], leaves[4], weight=1.0)
            out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.04, dv=512, backend="tilelang", indexer_loss=loss)
            grads = torch.autograd.grad(out, leaves, dout)
        got = (*grads, loss.value)
        assert all(torch.isfinite(x).all() for x in got)
        if first is None:
            first = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, first))


def test_fused_indexer_loss_with_the_topk_lse():
    """FusedIndexerLoss given the top-k's lse (the adapters' path: the loss program's single pass) gives the
    loss value and gradients of the two-pass program, within rounding; a shifted lse shifts the value (it is
    used, not recomputed)."""
    t, h, hi, di, k = 300, 64, 32, 128, 128
    q, kv, _, _ = _fresh(1, t, t, h, 576, k, False)
    g = torch.Generator().manual_seed(4)
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(t, di, generator=g).cuda().bfloat16()
    w = (torch.randn(t, hi, generator=g) * 0.05).cuda()
    start, end = ops.causal_key_windows(torch.tensor([0, t], device="cuda"))
    idx, i_lse = ops.indexer_topk(iq, ik, w, k, start, end, return_lse=True)
    dout = torch.randn(1, t, h, 512, device="cuda").bfloat16()
    results = []
    for given in (None, i_lse, i_lse + 0.5):
        leaves = [x.clone().requires_grad_() for x in (q, kv, iq, ik, w)]
        loss = ops.FusedIndexerLoss(leaves[2], leaves[3], leaves[4], weight=1.0, index_lse=given)
        out = ops.sparse_attention(leaves[0], leaves[1], idx[None], 0.04, dv=512, backend="tilelang",
                                   indexer_loss=loss)
        grads = torch.autograd.grad(out, leaves, dout)
        results.append((loss.value, grads))
    (v0, g0), (v1, g1), (v2, _) = results
    assert torch.isfinite(v1) and abs(v1.item() - v0.item()) <= 1e-5 * max(1.0, abs(v0.item()))
    for a, b in zip(g1[2:], g0[2:]):
        assert rel_err(a, b) < 1e-2
    assert abs((v2 - v1).item() - 0.5) < 1e-3  # every row has slots and a target: the mean shifts by 0.5


def test_no_quadratic_allocation_at_long_sequence():
    """S = Skv = 32K: a [S, Skv] fp32 score matrix would be 4 GiB; fwd+bwd must stay far below."""
    s, h, k = 32768, 16, 512
    q, kv, idx, _ = _fresh(1, s, s, h, 576, k, False)
    leaves = [t.clone().requires_grad_() for t in (q, kv)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = ops.sparse_attention(leaves[0], leaves[1], idx, 0.04, dv=512, backend="tilelang")
    torch.autograd.grad(out, leaves, torch.ones_like(out))
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30
    # out + dout + dq + fp32 dkv + lse: about 1.3 GiB of unavoidable tensors at this shape
    assert extra < 2.0, f"peak extra memory {extra:.2f} GiB"


def test_indexer_kernel_matches_reference_sets():
    t, hi, di, k = 3000, 64, 128, 512
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(t, di, generator=g).cuda().bfloat16()
    w = torch.rand(t, hi, generator=g).cuda() * 0.01
    cu = torch.tensor([0, 1, 700, 705, 3000], device="cuda", dtype=torch.int32)
    got = ops.tilelang_indexer_topk(iq, ik, w, cu, k)[:, 0]
    start, end = ops.causal_key_windows(cu)
    want = ops.indexer_topk(iq, ik, w, k, start, end, backend="torch")
    from dsa_plugins.reference import indexer_scores

    mismatched = 0
    for row in range(0, t, 7):
        a = set(got[row].tolist()) - {-1}
        b = set(want[row].tolist()) - {-1}
        if a != b:  # near-ties in fp32 accumulation order may swap the last element
            scores = indexer_scores(iq[row:row + 1], ik, w[row:row + 1], start[row:row + 1], end[row:row + 1])[0]
            sa = scores[list(a)].sort().values
            sb = scores[list(b)].sort().values
            assert len(a) == len(b) and (sa - sb).abs().max() < 1e-3 * scores[list(b)].abs().max()
            mismatched += 1
    assert mismatched <= 3


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not on PATH")
def test_memcheck_clean_on_invalid_indices(tmp_path):
    script = tmp_path / "memcheck_case.py"
    script.write_text(textwrap.dedent(
        """
        import torch
        from dsa_plugins import ops
        for h, d, dv, sink in ((64, 512, 512, True), (64, 576, 512, False)):
            q = torch.randn(1, 37, h, d, device="cuda").bfloat16().requires_grad_()
            kv = torch.randn(1, 50, d, device="cuda").bfloat16().requires_grad_()
            idx = torch.randint(-200, 200, (1, 37, 100), device="cuda", dtype=torch.int32)
            idx[:, ::3] = -1
            idx[:, 1::3] += 1000            # all out of range
            z = torch.randn(h, device="cuda").requires_grad_() if sink else None
            out = ops.sparse_attention(q, kv, idx, 0.05, sink=z, dv=dv, backend="tilelang")
            out.float().sum().backward()
            torch.cuda.synchronize()
        print("done")
        """
    ))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(script)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout


@pytest.mark.parametrize("index_lse", [False, True], ids=["two_passes", "index_lse"])
@pytest.mark.parametrize("with_lse", [False, True])
def test_indexer_kl_loss_kernel_matches_reference(with_lse, index_lse):
    t, h, dqk, hi, di, k = 300, 64, 576, 32, 128, 100
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q = torch.randn(t, h, dqk, generator=g).cuda().bfloat16()
    kv = torch.randn(t, dqk, generator=g).cuda().bfloat16()
    iq = torch.randn(t, hi, di, generator=g).cuda().bfloat16()
    ik = torch.randn(t, di, generator=g).cuda().bfloat16()
    w = torch.rand(t, hi, generator=g).cuda() * 0.02
    start, end = ops.causal_key_windows(torch.tensor([0, t], device="cuda"))
    idx, i_lse = ops.indexer_topk(iq, ik, w, k, start, end, return_lse=True)  # (the kernels' lse: index_lse)
    assert torch.equal(idx.sort(1).values, ops.indexer_topk(iq, ik, w, k, start, end).sort(1).values)
    lse = None
    if with_lse:
        _, lse = ops.sparse_attention(q, kv, idx, 0.04, dv=512, return_lse=True)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    losses, grads = [], []
    for backend in ("tilelang", "torch"):
        leaves = [x.clone().requires_grad_() for x in (iq, ik, w)]
        loss = ops.indexer_kl_loss(*leaves, q, kv, lse, 0.04, topk_indices=idx, backend=backend,
                                   index_lse=i_lse if index_lse else None)
        loss.backward()
        losses.append(loss.float())
        grads.append([x.grad.float() for x in leaves])
    assert torch.isfinite(losses[0])
    assert abs(losses[0].item() - losses[1].item()) < 1e-2 * abs(losses[1].item()) + 1e-4
    for a, b in zip(*grads):
        assert rel_err(a, b) < 3e-2


@pytest.mark.parametrize("sink", [False, True], ids=["mla", "v4_sink"])
def test_decode_step_first_called_under_compiled_cuda_graphs(sink):
    """A generation step whose first call of this shape is inside torch.compile's CUDA graphs
    (mode "reduce-overhead": warm-up runs allocate from the graph pool, which must hold no
    tensor the op keeps) gives the eager results, replay after replay."""
    torch._dynamo.reset()
    b, h, dqk = 3, 64, 512 if sink else 576
    q, kv, idx, z = _fresh(b, 1, 4099, h, dqk, 2048, sink)
    kw = dict(sink=z, dv=512, backend="tilelang")

    @torch.compile(mode="reduce-overhead", fullgraph=True)
    def step(q_, kv_, idx_):
        return ops.sparse_attention(q_, kv_, idx_, dqk ** -0.5, **kw) * 1.0

    got = [step(q, kv, idx).clone() for _ in range(4)]
    want = ops.sparse_attention(q, kv, idx, dqk ** -0.5, **kw)
    for g in got:
        assert torch.equal(g, want)
