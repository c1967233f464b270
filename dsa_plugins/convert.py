"""Checkpoint conversion between Hugging Face and Megatron-core key layouts (safetensors dirs).

    python -m dsa_plugins convert --to megatron SRC_HF_DIR DST_DIR [--layout local|te] [--experts sequential|grouped]
    python -m dsa_plugins convert --to hf SRC_MEGATRON_DIR DST_DIR

Tensors are read one at a time (``safetensors.safe_open``) and written in shards of at most
``--max-shard-size`` with a ``model.safetensors.index.json``; values and dtypes are never changed
(renames, plus the MLP gate/up concatenation and its exact split). Other files of SRC (config,
tokenizer) are copied. The Megatron side is a safetensors dir of ``GPTModel`` state-dict names
(load it with ``model.load_state_dict``; megatron's distributed checkpoint format is not written
here); ``dsa_plugins_convert.json`` in it records how it was made, for the way back.

Key tables: :mod:`dsa_plugins.adapters.megatron.keymap`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from typing import Iterable, Optional

from dsa_plugins.adapters.megatron.keymap import (
    EXPERT_LAYOUTS,
    FAMILIES,
    LAYOUTS,
    KeyMap,
    Source,
    detect_family,
    moe_layers_of,
)

INDEX_NAME = "model.safetensors.index.json"
META_NAME = "dsa_plugins_convert.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class SafetensorsDir:
    """Lazy reader of a (possibly sharded) safetensors directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:
            from safetensors import safe_open

            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no .safetensors files in {path}")
            self.weight_map = {}
            for name in files:
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in f.keys():
                        self.weight_map[key] = name
        self._handles: dict = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, key: str):
        from safetensors import safe_open

        name = self.weight_map[key]
        if name not in self._handles:
            self._handles[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._handles[name].get_tensor(key)

    def close(self) -> None:
        for h in self._handles.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles.clear()


def build(src: SafetensorsDir, source: Source):
    """One output tensor from its sources (bit-exact)."""
    import torch

    if source.op == "copy":
        return src.get(source.keys[0])
    if source.op == "cat0":
        a, b = (src.get(k) for k in source.keys)
        if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
            raise ValueError(
                f"cannot concatenate {source.keys}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            )
        return torch.cat([a, b], dim=0)
    if source.op in ("half0", "half1"):
        t = src.get(source.keys[0])
        if t.shape[0] % 2:
            raise ValueError(f"{source.keys[0]}: dim 0 ({t.shape[0]}) is odd, cannot split gate/up")
        return t.chunk(2, dim=0)[int(source.op[-1])].contiguous()
    raise ValueError(f"unknown op {source.op!r}")


def write_sharded(
    dst: str, items: Iterable[tuple[str, object]], max_shard_size: int, total: int, progress: bool
) -> dict:
    """Write (key, tensor) pairs into shards; returns the weight map."""
    from safetensors.torch import save_file

    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=total, unit="tensor", desc="convert", disable=not progress) if tqdm else None
    shards: list[list[str]] = []
    current: dict = {}
    size = 0
    total_size = 0

    def flush():
        nonlocal current, size
        if not current:
            return
        name = f"shard-{len(shards):05d}.tmp"
        save_file(current, os.path.join(dst, name), metadata={"format": "pt"})
        shards.append(list(current))
        current, size = {}, 0

    for key, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_size:
            flush()
        current[key] = tensor.contiguous()
        size += nbytes
        total_size += nbytes
        if bar is not None:
            bar.update(1)
    flush()
    if bar is not None:
        bar.close()
    weight_map = {}
    n = len(shards)
    for i, keys in enumerate(shards):
        final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(dst, f"shard-{i:05d}.tmp"), os.path.join(dst, final))
        weight_map.update({k: final for k in keys})
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(dst, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2)
    return weight_map


def _copy_side_files(src: str, dst: str, skip: tuple[str, ...] = ()) -> None:
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if name.endswith(".safetensors") or name == INDEX_NAME or name in skip or not os.path.isfile(path):
            continue
        shutil.copy2(path, os.path.join(dst, name))


def convert(
    src: str,
    dst: str,
    to: str,
    family: Optional[str] = None,
    layout: Optional[str] = None,
    experts: Optional[str] = None,
    num_layers: Optional[int] = None,
    max_shard_size: int = 5 * 10**9,
    progress: bool = True,
) -> dict:
    """Convert ``src`` into ``dst`` (``to`` = "megatron" | "hf"); returns the output weight map."""
    if to not in ("megatron", "hf"):
        raise ValueError(f"to must be 'megatron' or 'hf', got {to!r}")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError("SRC and DST must differ")
    reader = SafetensorsDir(src)
    keys = reader.keys()
    meta = {}
    if os.path.exists(os.path.join(src, META_NAME)):
        with open(os.path.join(src, META_NAME)) as f:
            meta = json.load(f)
    config = {}
    if os.path.exists(os.path.join(src, "config.json")):
        with open(os.path.join(src, "config.json")) as f:
            config = json.load(f)
    family = family or meta.get("family") or detect_family(keys, config.get("model_type"))
    layout = layout or meta.get("layout") or "local"
    experts = experts or meta.get("experts") or ("grouped" if layout == "te" else "sequential")
    if num_layers is None:
        num_layers = meta.get("num_layers") or config.get("num_hidden_layers")
    if to == "megatron":
        kmap = KeyMap(family, num_layers, layout, experts, moe_layers=moe_layers_of(keys))
        plan = kmap.plan_to_megatron(keys)
    else:
        if num_layers is None:
            layer_ids = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
            num_layers = max(layer_ids) + 1 if layer_ids else 0
        kmap = KeyMap(family, num_layers, layout, experts)
        plan = kmap.plan_to_hf(keys, num_layers)
    os.makedirs(dst, exist_ok=True)
    # read in source order (one shard file at a time), write as we go
    order = sorted(plan, key=lambda k: (reader.weight_map[plan[k].keys[0]], plan[k].keys[0], k))
    try:
        weight_map = write_sharded(
            dst, ((k, build(reader, plan[k])) for k in order), max_shard_size, len(order), progress
        )
    finally:
        reader.close()
    _copy_side_files(src, dst, skip=(META_NAME,))
    if to == "megatron":
        with open(os.path.join(dst, META_NAME), "w") as f:
            json.dump(
                {"family": family, "layout": layout, "experts": experts, "num_layers": num_layers, "source": "hf"},
                f, indent=2,
            )
    return weight_map


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dsa_plugins convert",
        description="Convert a safetensors checkpoint between HF and Megatron-core key layouts (bit-exact).",
    )
    parser.add_argument("--to", required=True, choices=("megatron", "hf"))
    parser.add_argument("src", help="source directory (safetensors, sharded or not)")
    parser.add_argument("dst", help="destination directory")
    parser.add_argument("--family", choices=FAMILIES, help="mla (DeepSeek-V3.2, GLM-5) or v4 (default: detected)")
    parser.add_argument("--layout", choices=LAYOUTS, help="megatron norm names: local (default) or te (fused)")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, help="megatron expert names (default by layout)")
    parser.add_argument("--num-layers", type=int, help="decoder layers (default: config.json; later layers are MTP)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    weight_map = convert(
        args.src, args.dst, args.to, family=args.family, layout=args.layout, experts=args.experts,
        num_layers=args.num_layers, max_shard_size=args.max_shard_size, progress=not args.no_progress,
    )
    print(f"wrote {len(weight_map)} tensors to {args.dst}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
