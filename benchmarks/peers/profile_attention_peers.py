"""One launch of ours and of the peer, each inside an NVTX range, for Nsight Compute.

    ncu --nvtx --nvtx-include "ours/" --nvtx-include "peer/" --clock-control none \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        python benchmarks/peers/profile_attention_peers.py --mode bwd --shape mla_h64

Both run once outside the ranges first (compilation, the peer's JIT, allocator warm-up), so the
profiled launches are the steady-state kernels. ``--mode fwd`` pairs ours with FlashMLA's sparse
prefill, ``bwd`` with cuDNN frontend's sm90 backward; the inputs are bench_attention_peers.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention_peers import SHAPES_8K, cudnn_backward, flashmla_forward, make_inputs  # noqa: E402
from common import import_peer  # noqa: E402

SHAPES = {"mla_h128": SHAPES_8K[0], "mla_h64": SHAPES_8K[1], "v4_h128": SHAPES_8K[2], "v4_h64": SHAPES_8K[3]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="bwd")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mla_h64")
    args = ap.parse_args(argv)
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    _, s, skv, h, dqk, dv, k, sink = SHAPES[args.shape]
    scale = dqk ** -0.5
    q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
    if args.mode == "fwd":
        flash_mla = import_peer("flash_mla", "flashmla")
        ours = lambda: sparse_attention_fwd(q, kv, idx, scale, sink=z, dv=dv)  # noqa: E731
        peer = None if flash_mla is None else (lambda: flashmla_forward(flash_mla, q, kv, idx, scale, dv, z))  # noqa: E731
    else:
        cudnn = import_peer("cudnn", "cudnn_fe")
        out, lse = sparse_attention_fwd(q, kv, idx, scale, sink=z, dv=dv)
        dout = 0.1 * torch.randn_like(out)
        ours = lambda: sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=dv)  # noqa: E731
        peer = None if cudnn is None else (  # noqa: E731
            lambda: cudnn_backward(cudnn.DSA, q, kv, idx, out, lse, dout, scale, z))
    for name, fn in (("ours", ours), ("peer", peer)):
        if fn is None:
            continue
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
