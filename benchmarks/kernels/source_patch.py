"""Text patches of a kernel module's source, for the measurement tools (the forward and backward tracers).

Each patch must find its anchor exactly as often as expected (else the program changed and the tool says so),
and the patched copy is imported as a module of its own inside ``dsa_plugins.kernels`` (its relative imports
resolve; TileLang reads the source from the file), leaving the shipped module untouched.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def replace_exact(src: str, old: str, new: str, count: int = 1) -> str:
    """``src`` with ``old`` replaced by ``new``, which must occur exactly ``count`` times."""
    found = src.count(old)
    if found != count:
        raise RuntimeError(f"trace patch: expected {count} of {old[:60]!r}..., found {found} (the program changed)")
    return src.replace(old, new)


def import_patched(source: str, name: str):
    """Import ``source`` as the module ``dsa_plugins.kernels._<name>`` (written to __pycache__/<name>.py here)."""
    import dsa_plugins.kernels  # noqa: F401  (the copy's relative imports)

    path = Path(__file__).resolve().parent / "__pycache__" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"dsa_plugins.kernels._{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
