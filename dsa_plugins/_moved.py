"""Import paths that moved in 0.2, kept working for one release with a DeprecationWarning.

``import dsa_plugins.patches.transformers`` (and the other old paths below) still works: a finder
at the end of ``sys.meta_path`` answers only for these names, warns once per name, and hands out
either the new module itself or, where one old module was split, a module that resolves each old
name from its new home. No file stands at the old paths, so the tree shows only the new layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old module -> new module, or {name: new module} where an old module was split.
MOVED: dict[str, str | dict[str, str]] = {
    "dsa_plugins._config": "dsa_plugins.common.settings",
    "dsa_plugins._indices": "dsa_plugins.common.indices",
    "dsa_plugins._validation": "dsa_plugins.common.validation",
    "dsa_plugins.patches.megatron": "dsa_plugins.adapters.megatron.spec_patches",
    "dsa_plugins.patches._core": {
        **dict.fromkeys(("PatchPointMissing", "applied_keys", "is_patched", "patch_attribute", "revert_patches"),
                        "dsa_plugins.patches.attributes"),
        **dict.fromkeys(("UnsupportedVersion", "installed_version", "require_version"),
                        "dsa_plugins.patches.versions"),
    },
    "dsa_plugins.benchmarking": {
        **dict.fromkeys(("Case", "COLUMNS", "median_ms", "run_cases", "time_callable", "write_results", "env_info"),
                        "dsa_plugins.bench.runner"),
        **dict.fromkeys(("ANCHORS", "build_suite", "main"), "dsa_plugins.bench.suites"),
    },
    "dsa_plugins.patches.transformers": {
        "ATTN_NAME": "dsa_plugins.adapters.hf.constants",
        **dict.fromkeys(("DenseMask", "LazyMask", "TopkSelection", "as_mask", "dsa_mask", "mask_indices",
                         "unique_key_columns"), "dsa_plugins.adapters.hf.masks"),
        "dsa_attention_forward": "dsa_plugins.adapters.hf.attention",
        "select_topk": "dsa_plugins.adapters.hf.indexer",
        "glm5_next_select": "dsa_plugins.adapters.hf.models.glm5_next",
        **dict.fromkeys(("MODELS", "UNSUPPORTED", "model_available", "patch_model", "supported_models"),
                        "dsa_plugins.adapters.hf.models"),
        **dict.fromkeys(("check_version", "register_attention", "register_mask", "unregister_interfaces"),
                        "dsa_plugins.adapters.hf.interfaces"),
        "UnsupportedVersion": "dsa_plugins.patches.versions",
        "unpatch_all": "dsa_plugins.adapters.hf",
    },
}
_RENAMED = {("dsa_plugins.patches.transformers", "unpatch_all"): "unregister"}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, target: str | dict[str, str]):
        self.target = target

    def create_module(self, spec):
        return None  # a plain module; exec_module fills or replaces it

    def exec_module(self, module) -> None:
        old, target = module.__name__, self.target
        where = target if isinstance(target, str) else " and ".join(sorted({".".join(t.split(".")[:3])
                                                                            for t in target.values()}))
        # stacklevel 2: the importing line (warnings skips the import machinery's frames itself)
        warnings.warn(f"{old} moved to {where}; the old import path will be removed in the next release",
                      DeprecationWarning, stacklevel=2)
        if isinstance(target, str):
            sys.modules[old] = importlib.import_module(target)  # the import statement binds this
            return

        def __getattr__(name: str):
            if name not in target:
                raise AttributeError(f"module {old!r} has no attribute {name!r}")
            value = getattr(importlib.import_module(target[name]), _RENAMED.get((old, name), name))
            setattr(module, name, value)
            return value

        module.__getattr__ = __getattr__
        module.__all__ = sorted(target)


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(MOVED[fullname]))


def install() -> None:
    """Append the finder to ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def reset(name: str) -> None:
    """Forget an old module so that importing it warns again (tests)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules and isinstance(sys.modules[parent], types.ModuleType):
        sys.modules[parent].__dict__.pop(child, None)
