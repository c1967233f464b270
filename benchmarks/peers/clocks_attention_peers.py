"""SM clock and board power while ours and the peer run back to back, for the backward's same-run gap.

    python benchmarks/peers/clocks_attention_peers.py --shape mla_h128 [--seconds 4]

Each backward (ours, then cuDNN frontend's sm90 one when staged) runs in a loop for ``--seconds`` while
``nvidia-smi`` samples the SM and memory clocks, power draw and temperature every 100 ms; prints the medians and each
one's time per call. Nsight Compute locks the clocks to base, so its per-kernel times can rank two kernels
differently from a benchmark at boost clocks: this says whether one of them runs at a lower clock.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention_peers import cudnn_backward, make_inputs  # noqa: E402
from common import import_peer  # noqa: E402
from profile_attention_peers import SHAPES  # noqa: E402

QUERY = "clocks.sm,clocks.mem,power.draw,temperature.gpu"


def sampled(fn, seconds: float) -> tuple[float, dict]:
    """(ms per call, median of each sampled field) over a loop of ``fn`` lasting ``seconds``."""
    fn()
    torch.cuda.synchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / calls
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].strip().splitlines()[3:]]  # the first 300 ms: ramp
    fields = QUERY.split(",")
    med = {}
    for i, name in enumerate(fields):
        vals = [r[i] for r in rows if len(r) == len(fields)]
        try:
            med[name] = statistics.median(float(v) for v in vals)
        except ValueError:
            med[name] = max(set(vals), key=vals.count) if vals else "-"
    return ms, med


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mla_h128")
    ap.add_argument("--seconds", type=float, default=4.0)
    args = ap.parse_args(argv)
    from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    _, s, skv, h, dqk, dv, k, sink = SHAPES[args.shape]
    scale = dqk ** -0.5
    q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
    out, lse = sparse_attention_fwd(q, kv, idx, scale, sink=z, dv=dv)
    dout = 0.1 * torch.randn_like(out)
    runs = [("tilelang", lambda: sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=dv,
                                                      dkv_dtype=kv.dtype))]
    cudnn = import_peer("cudnn", "cudnn_fe")
    if cudnn is not None:
        runs.append(("cudnn_fe", lambda: cudnn_backward(cudnn.DSA, q, kv, idx, out, lse, dout, scale, z)))
    for rnd in range(2):
        for name, fn in runs:
            ms, med = sampled(fn, args.seconds)
            print(f"{torch.cuda.get_device_name()} | {args.shape} | {name} | round {rnd} | {ms:.3f} ms | "
                  + " | ".join(f"{key} {val}" for key, val in med.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
