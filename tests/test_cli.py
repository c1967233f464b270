import subprocess
import sys

from dsa_plugins import benchmarking
from dsa_plugins.cli import main


def test_doctor_reports_versions_backends_and_adapters(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for needle in ("dsa_plugins", "torch", "tilelang", "transformers", "megatron-core", "sparse_attention", "autoload"):
        assert needle in out
    assert "deterministic backward (DSA_PLUGINS_DETERMINISTIC): off" in out


def test_doctor_names_the_deterministic_mode(capsys, monkeypatch):
    monkeypatch.setenv("DSA_PLUGINS_DETERMINISTIC", "contrib_bf16")
    assert main(["doctor"]) == 0
    assert "deterministic backward (DSA_PLUGINS_DETERMINISTIC): on, mode contrib_bf16" in capsys.readouterr().out


def test_python_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "dsa_plugins", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "doctor" in proc.stdout


def test_bench_smoke_writes_csv_markdown_plot(tmp_path):
    assert main(["bench", "--suite", "smoke", "--providers", "torch", "--reps", "2", "--out", str(tmp_path), "--tag", "t"]) == 0
    csv_text = (tmp_path / "t.csv").read_text()
    assert "sparse_mla" in csv_text and "indexer_topk" in csv_text and "median_ms" in csv_text
    assert "| op |" in (tmp_path / "t.md").read_text()
    assert (tmp_path / "t.png").exists()


def test_time_callable_quantiles():
    import torch

    med, p20, p80, _ = benchmarking.time_callable(lambda: sum(range(100)), torch.device("cpu"), warmup=1, reps=7)
    assert p20 <= med <= p80
