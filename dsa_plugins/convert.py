"""Checkpoint conversion between Hugging Face and Megatron-core key layouts (safetensors dirs).

    python -m dsa_plugins convert --to megatron SRC_HF_DIR DST_DIR [--layout local|te] [--experts sequential|grouped]
                                  [--megatron 0.19|0.16] [--dequantize-fp8]
    python -m dsa_plugins convert --to hf SRC_MEGATRON_DIR DST_DIR

Tensors are read one at a time (``safetensors.safe_open``) and written in shards of at most
``--max-shard-size`` with a ``model.safetensors.index.json``; values and dtypes are never changed
(renames, plus the MLP gate/up concatenation and its exact split). Other files of SRC (config,
tokenizer) are copied. The Megatron side is a safetensors dir of ``GPTModel`` state-dict names
(load it with ``model.load_state_dict``; megatron's distributed checkpoint format is not written
here); ``dsa_plugins_convert.json`` in it records how it was made, for the way back.

MTP layers: ``--megatron`` picks the state-dict name of their inner decoder layer (0.19:
``mtp_model_layer``, the default; 0.16: ``transformer_layer``). An HF MTP layer's ``embed_tokens``
and ``shared_head.head`` are left out when they equal the model's embedding / ``lm_head`` (checked
tensor by tensor): megatron's MTP shares those, as Megatron-Bridge's mappings do. The way back
writes them from the shared tensors, so the round trip stays bit-exact. A copy that differs is
carried (``mtp.layers.i.embed_tokens.weight``), with a warning: megatron will not load it.

FP8 checkpoints (DeepSeek-V3.2's release: e4m3 weights with 128 x 128 block ``weight_scale_inv``)
are kept as they are unless ``--dequantize-fp8``: then each such weight is written in bf16
(weight * its block's scale, as DeepSeek's own cast and Megatron-Bridge's DeepSeek bridge do) and
the scales are left out, so that a bf16 ``GPTModel`` loads them. The only conversion that changes
values; the way back writes bf16.

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
    MTP_LAYER_NAMES,
    KeyMap,
    Source,
    detect_family,
    moe_layers_of,
)

INDEX_NAME = "model.safetensors.index.json"
#: megatron-core release -> the state-dict name of an MTP layer's decoder layer
MEGATRON_MTP_LAYER = {"0.19": MTP_LAYER_NAMES[0], "0.16": MTP_LAYER_NAMES[1]}
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

    def _handle(self, key: str):
        """The open file that holds ``key`` (each file opened once)."""
        name = self.weight_map[key]
        if name not in self._handles:
            from safetensors import safe_open

            self._handles[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._handles[name]

    def dtype(self, key: str) -> str:
        """The stored dtype ("BF16", "F8_E4M3", ...), read from the header only."""
        return self._handle(key).get_slice(key).get_dtype()

    def get(self, key: str):
        return self._handle(key).get_tensor(key)

    def close(self) -> None:
        for h in self._handles.values():
            exit_ = getattr(h, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)
        self._handles.clear()


def build(src: SafetensorsDir, source: Source):
    """One output tensor from its sources (bit-exact)."""
    import torch

    if source.op.startswith("dequant:"):  # (fp8 weight, its scale_inv), "dequant:ROWSxCOLS" blocks
        weight, scale_inv = (src.get(k) for k in source.keys)
        return fp8_block_dequant(weight, scale_inv, tuple(int(b) for b in source.op[len("dequant:"):].split("x")))
    if source.op == "copy":
        return src.get(source.keys[0])
    if source.op == "clone":  # a second output of one input: its own storage (safetensors refuses shared ones)
        return src.get(source.keys[0]).clone()
    if source.op == "cat0":
        a, b = (build(src, k) if isinstance(k, Source) else src.get(k) for k in source.keys)
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


def fp8_block_dequant(weight, scale_inv, block: tuple[int, int] = (128, 128)):
    """bf16 of an e4m3 ``weight`` [N, K] with block scales ``scale_inv`` [ceil(N/bn), ceil(K/bk)]:
    weight * scale of its block, rounded once to bf16."""
    import torch

    n, k = weight.shape
    bn, bk = block
    if scale_inv.shape != ((n + bn - 1) // bn, (k + bk - 1) // bk):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not tile a {tuple(weight.shape)} weight in "
                         f"{bn} x {bk} blocks")
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.float() * scale).to(torch.bfloat16)


def _fp8_dequant_plan(reader: SafetensorsDir, plan: dict[str, Source], block: tuple[int, int]) -> dict[str, Source]:
    """``plan`` with every e4m3 weight that has a ``weight_scale_inv`` sibling read as bf16 (its
    scale applied) and the scales left out."""
    keys = set(reader.weight_map)
    scaled = {k: k[: -len("weight")] + "weight_scale_inv" for k in keys
              if k.endswith(".weight") and k[: -len("weight")] + "weight_scale_inv" in keys
              and reader.dtype(k) == "F8_E4M3"}
    used_scales = set(scaled.values())

    def read(key):
        return Source((key, scaled[key]), f"dequant:{block[0]}x{block[1]}") if key in scaled else key

    out = {}
    for name, src in plan.items():
        if src.keys[0] in used_scales:
            continue  # applied to its weight
        if src.op == "copy" and src.keys[0] in scaled:
            out[name] = read(src.keys[0])
        elif src.op == "cat0" and any(k in scaled for k in src.keys):
            out[name] = Source(tuple(read(k) for k in src.keys), "cat0")
        else:
            out[name] = src
    return out


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
    megatron: str = "0.19",
    dequantize_fp8: bool = False,
) -> dict:
    """Convert ``src`` into ``dst`` (``to`` = "megatron" | "hf"); returns the output weight map.
    ``megatron``: the megatron-core release whose MTP names to write ("0.19" or "0.16");
    ``dequantize_fp8``: write block-scaled e4m3 weights as bf16 and leave their scales out."""
    if megatron not in MEGATRON_MTP_LAYER:
        raise ValueError(f"megatron must be one of {sorted(MEGATRON_MTP_LAYER)}, got {megatron!r}")
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
    dropped = []
    if to == "megatron":
        kmap = KeyMap(family, num_layers, layout, experts, moe_layers=moe_layers_of(keys),
                      mtp_layer=MEGATRON_MTP_LAYER[megatron])
        dropped = _shared_copies(reader, kmap.mtp_shared_copies(keys))
        plan = kmap.plan_to_megatron([k for k in keys if k not in dropped])
        fp8_scaled = any(k.endswith(".weight_scale_inv") for k in keys)
        if dequantize_fp8:
            q = config.get("quantization_config") or {}
            plan = _fp8_dequant_plan(reader, plan, tuple(q.get("weight_block_size") or (128, 128)))
        elif fp8_scaled:
            print("note: fp8 weights and their weight_scale_inv are kept as they are (a bf16 GPTModel will not "
                  "load them); --dequantize-fp8 writes them in bf16")
    else:
        if num_layers is None:
            layer_ids = {int(m.group(1)) for k in keys if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}
            num_layers = max(layer_ids) + 1 if layer_ids else 0
        kmap = KeyMap(family, num_layers, layout, experts)
        # a dir we wrote names the MTP copies it left out; for any other, rebuild them all
        plan = kmap.plan_to_hf(keys, num_layers, mtp_copies=meta.get("mtp_copies_left_out"))
    os.makedirs(dst, exist_ok=True)
    # read in source order (one shard file at a time), write as we go
    def first_input(source: Source) -> str:
        key = source.keys[0]
        return first_input(key) if isinstance(key, Source) else key

    order = sorted(plan, key=lambda k: (reader.weight_map[first_input(plan[k])], first_input(plan[k]), k))
    try:
        weight_map = write_sharded(
            dst, ((k, build(reader, plan[k])) for k in order), max_shard_size, len(order), progress
        )
    finally:
        reader.close()
    _copy_side_files(src, dst, skip=(META_NAME,))
    quantization = None
    if to == "megatron" and dequantize_fp8 and "quantization_config" in config:
        # the weights are bf16 now: a config that still announced fp8 would make loaders build fp8 layers
        quantization = config.pop("quantization_config")
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    if to == "megatron":
        with open(os.path.join(dst, META_NAME), "w") as f:
            json.dump(
                {"family": family, "layout": layout, "experts": experts, "num_layers": num_layers, "source": "hf",
                 "megatron": megatron, "mtp_copies_left_out": dropped, "fp8_dequantized": bool(dequantize_fp8),
                 "quantization_config_removed": quantization},
                f, indent=2,
            )
    return weight_map


def _shared_copies(reader: SafetensorsDir, copies: dict[str, str]) -> list[str]:
    """The HF MTP copies (key -> shared key) equal to their shared tensor, to leave out of the
    megatron side; a copy that differs is kept, with a warning."""
    import torch

    same = []
    for key, shared in sorted(copies.items()):
        a, b = reader.get(key), reader.get(shared)
        if a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            same.append(key)
        else:
            print(f"warning: {key} differs from {shared}; carried as an extra megatron key that megatron's MTP "
                  f"(which shares {shared}) will not load")
    return same


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
    parser.add_argument("--megatron", choices=sorted(MEGATRON_MTP_LAYER), default="0.19",
                        help="megatron-core release whose MTP layer names to write (default 0.19)")
    parser.add_argument("--dequantize-fp8", action="store_true",
                        help="write block-scaled fp8 weights (weight_scale_inv) as bf16 and leave the scales out")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    weight_map = convert(
        args.src, args.dst, args.to, family=args.family, layout=args.layout, experts=args.experts,
        num_layers=args.num_layers, max_shard_size=args.max_shard_size, progress=not args.no_progress,
        megatron=args.megatron, dequantize_fp8=args.dequantize_fp8,
    )
    print(f"wrote {len(weight_map)} tensors to {args.dst}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
