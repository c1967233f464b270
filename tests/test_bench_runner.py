"""Results files: rows keep their columns when the column list grows, and other files are refused; the A/B
rounds' timing helper."""

import csv

import pytest

from dsa_plugins.bench.runner import COLUMNS, write_results


def test_appending_to_an_older_file_upgrades_its_header(tmp_path):
    old_cols = [c for c in COLUMNS if c != "variant"]
    path = tmp_path / "k.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_cols)
        w.writeheader()
        w.writerow({c: "-" for c in old_cols} | {"op": "old", "median_ms": "1.500", "git": "abc"})
    write_results([{"op": "new", "mode": "fwd", "shape": "B1", "provider": "tilelang", "variant": "split512",
                   "median_ms": 0.07071}], tmp_path, "k")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert [r["op"] for r in rows] == ["old", "new"]
    assert rows[0]["median_ms"] == "1.500" and rows[0]["git"] == "abc" and rows[0]["variant"] == "-"
    assert rows[1]["variant"] == "split512" and rows[1]["median_ms"] == "0.07071"  # microseconds survive


def test_a_file_with_columns_of_its_own_is_refused(tmp_path):
    path = tmp_path / "floor.csv"
    path.write_text("dim,mode,ms\n128,red,3.3\n")
    with pytest.raises(ValueError, match="columns of its own"):
        write_results([{"op": "x", "mode": "fwd", "shape": "B1", "provider": "tilelang"}], tmp_path, "floor")
    assert path.read_text() == "dim,mode,ms\n128,red,3.3\n"


def test_interleaved_graph_timing_alternates_and_skips_missing_graphs(monkeypatch):
    """A/B rounds: forward order on even rounds, backward on odd ones; a None graph gets no times; the ratio
    text is base / variant per round, median [min, max]."""
    from dsa_plugins.bench import runner

    calls = []
    monkeypatch.setattr(runner, "graph_replay_ms", lambda g, reps: calls.append(g) or float(g))
    times = runner.interleaved_graph_ms([1, None, 2], rounds=3, replays=5)
    assert calls == [1, 2, 2, 1, 1, 2] and times == [[1.0, 1.0, 1.0], [], [2.0, 2.0, 2.0]]
    assert runner.ratio_text([2.0, 4.0, 3.0], [1.0, 1.0, 1.0]) == "3.000 [2.000, 4.000]"


def test_interleaved_eager_timing_alternates_like_the_graph_timing(monkeypatch):
    """The eager A/B (calls that cannot be captured) takes the same alternating order and budget per call."""
    from dsa_plugins.bench import runner

    calls = []
    monkeypatch.setattr(runner, "calls_ms", lambda f, budget: calls.append((f(), budget)) or float(f()))
    times = runner.interleaved_calls_ms([lambda: 1, lambda: 2], rounds=2, budget_ms=50.0)
    assert calls == [(1, 50.0), (2, 50.0), (2, 50.0), (1, 50.0)] and times == [[1.0, 1.0], [2.0, 2.0]]
