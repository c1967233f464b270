import logging

import pytest

transformers = pytest.importorskip("transformers")


@pytest.fixture
def registered():
    """dsa_plugins' transformers adapter registered for the test, reverted after it."""
    from dsa_plugins import hf

    hf.register()
    yield hf
    hf.unregister()


@pytest.fixture(autouse=True)
def _quiet_fallback_warnings():
    logger = logging.getLogger("dsa_plugins")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def batch(seed: int = 0, batch_size: int = 2, seq_len: int = 14, pad: int = 3, vocab: int = 128):
    """Random ids with left padding on the last row (``pad`` tokens)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch_size, seq_len), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[-1, :pad] = 0
    return ids, mask


def output_tensor(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.fixture
def make_batch():
    return batch


@pytest.fixture
def output_of():
    return output_tensor
