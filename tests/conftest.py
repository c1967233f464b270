import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """Each test starts with the one-time warnings forgotten and default env settings."""
    from dsa_plugins.common.settings import reset_warnings

    for name in ("DSA_PLUGINS_BACKEND", "DSA_PLUGINS_CHECK_INDICES", "DSA_PLUGINS_DETERMINISTIC"):
        monkeypatch.delenv(name, raising=False)
    reset_warnings()
    yield
    reset_warnings()
