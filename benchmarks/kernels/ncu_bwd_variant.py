"""One launch of the backward's main program for Nsight Compute, with a tuning variant.

    ncu --kernel-name regex:dsa_bwd_ws --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python benchmarks/kernels/ncu_bwd_variant.py v4_h128_sink '{"ws_pair": true}'

Calls the backward twice on the same inputs (the first compiles and warms up); skip one launch to profile
the second. Shapes are bench_sparse_attention_bwd.py's.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_sparse_attention_bwd import LONG_SHAPES, SHAPES, make_inputs  # noqa: E402


def main() -> None:
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd

    name, variant = sys.argv[1], json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    _, B, S, Skv, H, Dqk, Dv, K, sink = next(s for s in SHAPES + LONG_SHAPES if s[0] == name)
    q, kv, idx, out, lse, dout, z, scale = make_inputs(B, S, Skv, H, Dqk, Dv, K, sink, causal=name.endswith("_causal"))
    for _ in range(2):
        sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv, config=variant)
    import torch

    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
