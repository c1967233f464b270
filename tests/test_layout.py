"""The package's imports flow one way and form no cycle (function-level imports included).

Layers, lowest first; a module may import its own group and the groups of lower layers only:

    common | patches  ->  kernels | reference  ->  ops  ->  adapters.hf | adapters.megatron  ->  top
    (top: the package root, entry points, CLI, bench, the hf / megatron shortcuts)

Groups of one layer do not import each other (kernels never use the reference, the HF adapter
never uses the Megatron one), except that both adapters may use ``adapters/__init__`` (the
``Adapter`` record).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsa_plugins

ROOT = Path(dsa_plugins.__file__).parent
PACKAGE = "dsa_plugins"

# group -> layer; a module belongs to the longest group prefix of its name, else to "top"
GROUPS = {
    "dsa_plugins.common": 0,
    "dsa_plugins.patches": 0,
    "dsa_plugins.kernels": 1,
    "dsa_plugins.reference": 1,
    "dsa_plugins.ops": 2,
    "dsa_plugins.adapters": 3,  # adapters/__init__: the Adapter record and discovery
    "dsa_plugins.adapters.hf": 3,
    "dsa_plugins.adapters.megatron": 3,
    "top": 4,
}
SHARED_SAME_LAYER = {"dsa_plugins.adapters"}  # importable by the other groups of its layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its file (lazy imports included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in known else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` where c is a name: the module a.b
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def group_of(name: str) -> str:
    best = "top"
    for group in GROUPS:
        if group != "top" and (name == group or name.startswith(group + ".")) and len(group) > len(best if best != "top" else ""):
            best = group
    return best


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """Upward imports and imports between groups of one layer."""
    bad = []
    for src, targets in edges.items():
        g_src = group_of(src)
        for dst in sorted(targets):
            g_dst = group_of(dst)
            if g_src == g_dst or (g_dst in SHARED_SAME_LAYER and GROUPS[g_src] == GROUPS[g_dst]):
                continue
            if GROUPS[g_dst] >= GROUPS[g_src]:
                bad.append(f"{src} ({g_src}) imports {dst} ({g_dst})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def edges() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def test_imports_flow_one_way(edges):
    assert layering_violations(edges) == []


def test_no_import_cycles(edges):
    assert cycles(edges) == []


def test_the_checks_catch_what_they_forbid():
    """The checker itself: an upward import, a sideways one between adapters, and a cycle."""
    bad = {
        "dsa_plugins.kernels.x": {"dsa_plugins.ops.y"},
        "dsa_plugins.adapters.hf.a": {"dsa_plugins.adapters.megatron.b", "dsa_plugins.adapters"},
        "dsa_plugins.ops.y": {"dsa_plugins.ops.z"},
        "dsa_plugins.ops.z": {"dsa_plugins.ops.y"},
    }
    assert layering_violations(bad) == [
        "dsa_plugins.kernels.x (dsa_plugins.kernels) imports dsa_plugins.ops.y (dsa_plugins.ops)",
        "dsa_plugins.adapters.hf.a (dsa_plugins.adapters.hf) imports dsa_plugins.adapters.megatron.b "
        "(dsa_plugins.adapters.megatron)",
    ]
    assert cycles(bad) == [["dsa_plugins.ops.y", "dsa_plugins.ops.z"]]


def test_relative_imports_are_resolved(edges):
    """The walker sees relative, lazy and `from package import submodule` imports (or it would pass vacuously)."""
    assert "dsa_plugins.ops.attention_custom_ops" in edges["dsa_plugins.ops.sparse_attention"]
    assert "dsa_plugins.ops" in edges["dsa_plugins.adapters.megatron.attention"]  # `from ... import ops`
    assert "dsa_plugins.adapters.hf.interfaces" in edges["dsa_plugins.adapters.hf"]  # inside register()


def test_modules_stay_small_or_say_why():
    """No module over ~500 lines without a reason stated in its docstring ("Size:")."""
    long = []
    for name, path in package_modules().items():
        lines = path.read_text().count("\n")
        if lines > 520 and "Size:" not in (ast.get_docstring(ast.parse(path.read_text())) or ""):
            long.append(f"{name}: {lines} lines")
    assert long == []


@pytest.mark.parametrize(
    "old, name, new",
    [
        ("dsa_plugins.patches.transformers", "LazyMask", "dsa_plugins.adapters.hf.masks"),
        ("dsa_plugins.patches.transformers", "dsa_attention_forward", "dsa_plugins.adapters.hf.attention"),
        ("dsa_plugins.patches.megatron", "apply_dsa_to_megatron", "dsa_plugins.adapters.megatron.spec_patches"),
        ("dsa_plugins.patches._core", "patch_attribute", "dsa_plugins.patches.attributes"),
        ("dsa_plugins._config", "warn_once", "dsa_plugins.common.settings"),
        ("dsa_plugins._indices", "as_int32", "dsa_plugins.common.indices"),
        ("dsa_plugins._validation", "check_tensor", "dsa_plugins.common.validation"),
        ("dsa_plugins.benchmarking", "median_ms", "dsa_plugins.bench.runner"),
        ("dsa_plugins.benchmarking", "build_suite", "dsa_plugins.bench.suites"),
    ],
)
def test_old_import_paths_warn_and_still_work(old, name, new):
    """0.1's import paths keep working for one release, with a DeprecationWarning naming the new home."""
    import importlib

    from dsa_plugins import _moved

    if old == "dsa_plugins.patches.megatron":
        pytest.importorskip("megatron.core")
    _moved.reset(old)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
    _moved.reset(old)
