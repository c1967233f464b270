"""The index helpers every path shares (DSA.md 2: any index < 0 or >= the key count is no key)."""

import torch

from dsa_plugins.common.indices import global_rows, row_blocks


def test_row_blocks_counts_to_the_last_valid_slot():
    idx = torch.full((6, 192), -1, dtype=torch.int32)
    idx[0, 0] = 3  # one slot
    idx[2, :64] = 7  # exactly one block
    idx[3, 64] = 1  # first slot of the second block
    idx[4, ::5] = 2  # holes; the last valid slot is 190
    idx[5, 100] = 9  # out of range for 9 keys: no valid slot
    assert row_blocks(idx, 64).tolist() == [1, 0, 1, 2, 3, 2]
    assert row_blocks(idx, 64, n_keys=9).tolist() == [1, 0, 1, 2, 3, 0]
    assert row_blocks(idx, 128).tolist() == [1, 0, 1, 1, 2, 1]
    assert row_blocks(idx[:0], 64).tolist() == []
    assert row_blocks(torch.empty(3, 0, dtype=torch.int32), 64).tolist() == [0, 0, 0]


def test_row_blocks_bounds_its_temporaries(monkeypatch):
    """Many rows are counted a slice at a time (here 7 rows of 40 slots, by the budget), with the
    same result."""
    from dsa_plugins.common import indices

    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, 50, (3000, 40), generator=g, dtype=torch.int32)
    idx[:, 30:] = -1
    idx[::11] = -1
    last = torch.where(idx >= 0, torch.arange(1, 41, dtype=torch.int32), 0).amax(1)
    monkeypatch.setattr(indices, "_ROW_BLOCKS_TEMP_BYTES", 7 * 40 * 8)
    rows_seen = []
    where = torch.where

    def recording_where(cond, *args):
        rows_seen.append(cond.shape[0])
        return where(cond, *args)

    monkeypatch.setattr(torch, "where", recording_where)
    assert torch.equal(row_blocks(idx, 8), (last + 7) // 8)
    assert max(rows_seen) == 7 and len(rows_seen) == -(-3000 // 7)  # 7 rows at a time


def test_global_rows_offsets_each_batch_and_drops_invalid():
    idx = torch.tensor([[[0, 4, -1]], [[2, 5, 7]]])
    assert global_rows(idx, 5).tolist() == [[0, 4, -1], [7, -1, -1]]
