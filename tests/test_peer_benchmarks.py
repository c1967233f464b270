"""The peer benchmarks (benchmarks/peers/*.py) import without a GPU or the peers installed, and the
scripts' command lines parse (--help). GPU and peer work must stay inside their functions."""

import importlib.util
import sys
from pathlib import Path

import pytest

PEERS = sorted((Path(__file__).resolve().parent.parent / "benchmarks" / "peers").glob("*.py"))


def _load(path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put their folder first: undone after
    monkeypatch.setitem(sys.modules, "common", None)  # recorded, so that teardown restores sys.modules["common"]
    del sys.modules["common"]  # each script imports benchmarks/peers/common.py afresh
    spec = importlib.util.spec_from_file_location(f"_peer_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", PEERS, ids=[p.name for p in PEERS])
def test_peer_benchmark_imports_and_parses(path, monkeypatch, capsys):
    module = _load(path, monkeypatch)
    if not hasattr(module, "main"):  # a shared helper (common.py)
        return
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exc:
        module.main()
    assert exc.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_cudnn_indexer_bench_loss_flags(monkeypatch, capsys):
    """--skip-loss skips both losses, --skip-dense the dense (warm-up) one: both are on the command line."""
    module = _load(next(p for p in PEERS if p.name == "bench_cudnn_indexer.py"), monkeypatch)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    out = capsys.readouterr().out
    assert "--skip-loss" in out and "--skip-dense" in out
