"""Index tensors: the int32 conversion and the batch-flattened rows every path uses.

Convention (DSA.md 2): any index < 0 or >= the number of keys means "no key". The conversion to
int32 clamps first, so that no int64 value (say 2**32 + 5) wraps onto a valid row.
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_int32(indices: Tensor, n_keys: int) -> Tensor:
    """Any integer dtype -> int32 with the same valid entries; invalid ones stay invalid
    (entries < -1 become -1 and entries > n_keys become n_keys). int32 input is returned as is."""
    if indices.dtype == torch.int32:
        return indices
    return indices.clamp(-1, n_keys).to(torch.int32)


def global_rows(indices: Tensor, n_keys: int) -> Tensor:
    """[B, S, K] rows into each batch's n_keys keys -> [B*S, K] int32 rows of the batch-flattened
    keys (b * n_keys + j), -1 where the entry is invalid."""
    b = indices.shape[0]
    idx = as_int32(indices, n_keys)
    offs = (torch.arange(b, device=idx.device, dtype=torch.int32) * n_keys).view(b, 1, 1)
    rows = torch.where((idx >= 0) & (idx < n_keys), idx + offs, -1)
    return rows.reshape(-1, indices.shape[-1])


_ROW_BLOCKS_TEMP_BYTES = 64 << 20


def row_blocks(indices: Tensor, block: int, n_keys: int | None = None) -> Tensor:
    """[R, K] indices -> [R] int32: the blocks of ``block`` slots each row must walk to reach its
    last valid slot (0 for a row without one). The kernels stop a row there: causal rows and the
    first tokens of packed sequences hold -1 after their few keys. Valid means >= 0 (and < n_keys
    when given). Computed a few rows at a time (at most 64 MiB of temporaries)."""
    r, k = indices.shape
    pos = torch.arange(1, k + 1, device=indices.device, dtype=torch.int32)
    out = torch.empty(r, dtype=torch.int32, device=indices.device)
    step = max(1, _ROW_BLOCKS_TEMP_BYTES // (8 * max(1, k)))  # a bool mask or two and an int32 per slot
    for r0 in range(0, r, step):
        part = indices[r0 : r0 + step]
        valid = part >= 0 if n_keys is None else (part >= 0) & (part < n_keys)
        last = torch.where(valid, pos, 0).amax(1) if k else torch.zeros(part.shape[0], dtype=torch.int32,
                                                                         device=part.device)
        out[r0 : r0 + step] = torch.div(last + (block - 1), block, rounding_mode="floor")
    return out
