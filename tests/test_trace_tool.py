"""The forward tracing tool patches the program's source as text: the patches must keep applying."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "trace_sparse_attention_fwd.py"


def _tool():
    spec = importlib.util.spec_from_file_location("trace_sparse_attention_fwd", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ablate", [(), ("no_q", "no_store")])
def test_trace_patches_apply_to_the_forward_source(ablate):
    tool = _tool()
    src = tool.traced_source(ablate)
    compile(src, "traced_fwd.py", "exec")  # still Python
    assert src.count('"dsa_trace"') == 10 and "Trace: T.Tensor([TRN, 16]" in src
    assert ("h0 + hh < -1, Q[" in src) == ("no_q" in ablate)
    with pytest.raises(RuntimeError, match="the program changed"):
        tool._replace(src, "no such line", "x")
