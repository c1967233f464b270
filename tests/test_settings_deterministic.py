"""dsa_plugins.deterministic(): the block that turns the deterministic backward on in code."""

import dsa_plugins
from dsa_plugins.common.settings import deterministic_enabled


def test_deterministic_block_turns_the_backward_on_and_restores(monkeypatch):
    assert not deterministic_enabled()
    with dsa_plugins.deterministic():
        assert deterministic_enabled()
        with dsa_plugins.deterministic():
            assert deterministic_enabled()
        assert deterministic_enabled()
    assert not deterministic_enabled()
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "1")
    assert deterministic_enabled()  # the variable still counts outside a block


def test_the_ops_record_the_block_for_their_backward():
    """The flag is read in the forward (custom op's context) and kept for the backward, run after the block."""
    import torch

    from dsa_plugins.ops import attention_custom_ops

    q = torch.randn(1, 5, 2, 16, requires_grad=True)
    kv = torch.randn(1, 7, 16, requires_grad=True)
    idx = torch.randint(0, 7, (1, 5, 3), dtype=torch.int32)
    seen = []
    real = attention_custom_ops.deterministic_enabled
    attention_custom_ops.deterministic_enabled = lambda: seen.append(real()) or seen[-1]
    try:
        with dsa_plugins.deterministic():
            out = dsa_plugins.sparse_attention(q, kv, idx, 0.25, backend="torch")
        out.sum().backward()
        plain = dsa_plugins.sparse_attention(q, kv, idx, 0.25, backend="torch")
    finally:
        attention_custom_ops.deterministic_enabled = real
    assert seen == [True, False] and plain.shape == out.shape and q.grad is not None


def test_torch_deterministic_algorithms_turn_it_on():
    """torch.use_deterministic_algorithms(True) (transformers' enable_full_determinism sets it) asks every op
    for a deterministic implementation: ours is the deterministic backward."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert deterministic_enabled()
        torch.use_deterministic_algorithms(False)
        assert not deterministic_enabled()
    finally:
        torch.use_deterministic_algorithms(before)


def _fake_loss_kernel(seen):
    """Stands in for the TileLang loss wrappers on the CPU: records the mode it is given."""
    import torch

    def run(index_q, index_k, weights, *args, grad_rows=None, deterministic=None, index_lse=None):
        seen.append(deterministic)
        grads = (torch.zeros_like(index_q), torch.zeros(index_k.shape), torch.zeros(weights.shape))
        return torch.zeros(index_q.shape[0]), grads

    return run


def test_the_indexer_loss_ops_hand_the_mode_to_the_loss_kernel(monkeypatch):
    """The sparse indexer KL loss kernel sums d_index_k in a fixed order in deterministic mode: the standalone
    op and the fused attention + loss both pass the flag read in the forward. The dense stage's kernels are
    reproducible in either mode (no atomics): they take no flag (None here)."""
    import torch

    from dsa_plugins.kernels import indexer_loss as kernel
    from dsa_plugins.ops import fused_indexer_loss
    from dsa_plugins.ops import indexer as ops_indexer

    seen = []
    monkeypatch.setattr(ops_indexer, "choose_kernel", lambda *a, **k: True)
    monkeypatch.setattr(ops_indexer, "load_kernel", lambda name: _fake_loss_kernel(seen))
    t, tk = 6, 9
    iq = torch.randn(t, 4, 16, requires_grad=True)
    ik = torch.randn(tk, 16, requires_grad=True)
    w = torch.randn(t, 4, requires_grad=True)
    q, kv = torch.randn(t, 2, 32), torch.randn(tk, 32)
    idx = torch.randint(0, tk, (t, 3), dtype=torch.int32)
    ends = torch.arange(1, t + 1, dtype=torch.int32)
    for det in (True, False):
        with dsa_plugins.deterministic() if det else torch.enable_grad():
            sparse = ops_indexer.indexer_kl_loss(iq, ik, w, q, kv, None, 0.2, topk_indices=idx)
            dense = ops_indexer.indexer_kl_loss(iq, ik, w, q, kv, None, 0.2, key_start=torch.zeros_like(ends),
                                                key_end=ends)
        (sparse + dense).backward()
    assert seen == [True, None, False, None]

    seen.clear()
    monkeypatch.setattr(fused_indexer_loss, "choose_kernel", lambda *a, **k: True)
    monkeypatch.setattr(kernel, "indexer_kl_loss_from_probs", _fake_loss_kernel(seen))
    loss = fused_indexer_loss.FusedIndexerLoss(iq, ik, w)
    probs = torch.rand(t, 3)
    for det in (True, False):
        fused_indexer_loss._loss_and_grads(loss, probs, idx, "tilelang", det)
    assert seen == [True, False]
