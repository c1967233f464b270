"""Shared test helpers: awkward index patterns and error measures."""

from __future__ import annotations

import re

import torch


def random_indices(b, s, k, skv, *, generator=None, invalid_frac=0.2, out_of_range=True, dup_frac=0.1, empty_rows=1):
    """[b, s, k] int32 with -1 padding, out-of-range entries (< -1 and >= skv), duplicates and
    `empty_rows` rows per batch with no valid slot."""
    g = generator
    idx = torch.randint(0, max(skv, 1), (b, s, k), generator=g)
    r = torch.rand(b, s, k, generator=g)
    idx = torch.where(r < invalid_frac, torch.full_like(idx, -1), idx)
    if out_of_range:
        idx = torch.where((r >= invalid_frac) & (r < invalid_frac + 0.05), idx + skv, idx)  # >= skv
        idx = torch.where((r >= invalid_frac + 0.05) & (r < invalid_frac + 0.08), torch.full_like(idx, -7), idx)
    if dup_frac and k > 1:
        dup = torch.rand(b, s, k, generator=g) < dup_frac
        idx = torch.where(dup, idx[..., :1].expand_as(idx), idx)
    for bi in range(b):
        for row in torch.randperm(s, generator=g)[: min(empty_rows, s)].tolist():
            idx[bi, row] = -1
    return idx.to(torch.int32)


def misaligned_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a contiguous view one element past an aligned base (a slice of a larger buffer), for the
    wrappers' 16-byte alignment copies."""
    v = torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)
    assert v.data_ptr() % 16
    return v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are 0); NaN/inf anywhere gives inf."""
    a64, b64 = a.double(), b.double()
    if not torch.isfinite(a64).all():
        return float("inf")
    denom = b64.norm().item()
    diff = (a64 - b64).norm().item()
    return diff / denom if denom > 0 else diff


def mla_checkpoint_keys(layers=3, experts=3, mtp=1, scale_inv=False):
    """HF keys of a DeepSeek-V3.2 / GLM-5 checkpoint: layer 0 dense, others MoE, then MTP layers."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    attn = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight",
            "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight"]
    for i in range(layers + mtp):
        p = f"model.layers.{i}."
        keys += [p + "self_attn." + a for a in attn]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if i == 0:
            keys += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        else:
            keys += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
            keys += [p + f"mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            for e in range(experts):
                keys += [p + f"mlp.experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if i >= layers:
            keys += [p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                     "shared_head.head.weight", "embed_tokens.weight")]
    if scale_inv:
        keys += [k.replace(".weight", ".weight_scale_inv") for k in keys if k.endswith("proj.weight")]
    return keys


def assert_waits_for_previous_grid(src: str) -> None:
    """A cluster program's CUDA source calls ``dsa_grid_dependency_wait()`` (griddepcontrol.wait) once per kernel
    and before its body indexes any pointer parameter: TileLang launches cluster programs with programmatic stream
    serialization, so the program may start before the previous kernel's writes are visible."""
    kernels = list(re.finditer(r"__global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(([^)]*)\)\s*\{", src))  # definitions only
    assert kernels, "no __global__ function defined in the source"
    for n, m in enumerate(kernels):
        body = src[m.end(): kernels[n + 1].start() if n + 1 < len(kernels) else len(src)]
        params = re.findall(r"\*\s*(?:__restrict__\s*)?(\w+)\s*(?:,|$)", m.group(2))
        assert params, f"{m.group(1)}: no pointer parameter found in {m.group(2)!r}"
        assert body.count("dsa_grid_dependency_wait();") == 1, f"{m.group(1)}: expected one grid dependency wait"
        before = body[: body.index("dsa_grid_dependency_wait();")]
        used = [p for p in params if re.search(rf"\b{p}\[", before) or re.search(rf"\b{p}_desc\b", before)]
        assert not used, f"{m.group(1)} reads {used} before its grid dependency wait"
