"""One launch of the radix top-k on few long rows for Nsight Compute (indexer-like scores, as bench_topk_configs.py).

    ncu --kernel-name regex:split --launch-skip 1 --launch-count 1 --section WarpStateStats \
        python benchmarks/kernels/ncu_topk_split.py [ROWS] [COLUMNS] [CONFIG_JSON]

Calls the top-k twice on the same scores (the first compiles); skip one launch to profile the second.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_topk_configs import scores  # noqa: E402
from dsa_plugins.kernels import topk as TK  # noqa: E402


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    cols = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    cfg = json.loads(sys.argv[3]) if len(sys.argv) > 3 else TK.SPLIT_CONFIG
    x = scores("indexer-like", rows, cols, torch.Generator(device="cuda").manual_seed(0))
    starts = torch.zeros(rows, dtype=torch.int32, device="cuda")
    ends = torch.full((rows,), cols, dtype=torch.int32, device="cuda")
    for _ in range(2):
        TK.topk_rows_ranges(x, starts, ends, 2048, config=cfg)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
