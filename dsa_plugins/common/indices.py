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
