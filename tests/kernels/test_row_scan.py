"""The per-row block counts (``skip_tail``): the one-launch program compiles for sm_90a on the CPU, refuses
bad input by name, and on a GPU gives what ``common.indices.row_blocks`` gives (valid: entries >= 0) on
awkward rows: all -1, -1 in the middle or at the end only, entries past any key length and below -1, K = 1,
K not a multiple of the block or of the CTA's threads, and one long row."""

import importlib.util

import pytest
import torch

from dsa_plugins.common.indices import row_blocks
from dsa_plugins.kernels import row_scan

SM90A = {"kind": "cuda", "arch": "sm_90a"}
HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def test_rejects_bad_indices_by_name():
    with pytest.raises(ValueError, match="row_blocks_cuda: indices must be"):
        row_scan.row_blocks_cuda(torch.zeros(4, 8, dtype=torch.int32), 128)  # on the CPU
    with pytest.raises(ValueError, match="torch.int64"):
        row_scan.row_blocks_cuda(torch.zeros(4, 8, dtype=torch.int64), 128)
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        row_scan.row_blocks_cuda(torch.zeros(4, 8, dtype=torch.int32), 0)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
def test_counting_program_compiles_for_sm90a():
    kernel = row_scan.build_row_blocks(target=SM90A)
    src = kernel.get_kernel_source()
    assert f"dsa_row_last_scan<{row_scan.ROW_SCAN_THREADS}>" in src and "int block, int rows, int slots" in src
    assert row_scan.build_row_blocks(target=SM90A) is kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k", (1, 5, 127, 128, 129, 300, 2048, 2049, 9000))
@pytest.mark.parametrize("block", (64, 128))
def test_counts_match_the_torch_rows(k, block):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(k * 7 + block)
    r = 37
    idx = torch.randint(0, 5000, (r, k), generator=gen, device="cuda", dtype=torch.int32)
    idx[0] = -1  # no valid slot: 0 blocks
    idx[1, k // 2 :] = -1  # valid head, -1 tail
    idx[2, : k // 2] = -1  # -1 head, valid tail
    idx[3, ::3] = -1  # -1 scattered
    idx[4, -1:] = -7  # below -1 counts as invalid
    idx[5, -1] = 10**9  # past any key length counts as valid here
    drop = torch.rand(r, k, generator=gen, device="cuda") < 0.5
    idx[6:] = torch.where(drop[6:], -1, idx[6:])
    for row in range(7, r):  # random last valid slot
        idx[row, int(torch.randint(0, k + 1, (1,), generator=gen, device="cuda")) :] = -1
    got = row_scan.row_blocks_cuda(idx, block)
    assert torch.equal(got, row_blocks(idx, block)), (got[:8], row_blocks(idx, block)[:8])
    assert got[0] == 0 and got[5] == -(-k // block)
    empty = row_scan.row_blocks_cuda(idx[:0], block)
    assert empty.shape == (0,)
