"""Every script in examples/ runs as written (on the CPU here: the torch reference path)."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(script):
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=script.parent.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
