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


def test_deterministic_mode_says_once_that_the_indexer_loss_kernel_is_not(caplog):
    """The indexer KL loss kernel sums d_index_k with fp32 atomics: in deterministic mode that is said once
    (never silently); the attention gradients are the deterministic ones."""
    import logging

    from dsa_plugins.ops import fused_indexer_loss

    with caplog.at_level(logging.WARNING, logger="dsa_plugins"):
        fused_indexer_loss.warn_loss_not_deterministic()
        fused_indexer_loss.warn_loss_not_deterministic()
    msgs = [r.getMessage() for r in caplog.records if "d_index_k still sums with fp32 atomics" in r.getMessage()]
    assert len(msgs) == 1
