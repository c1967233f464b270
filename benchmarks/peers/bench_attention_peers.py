"""Sparse attention, ours beside the peers, in one process on the same inputs.

    python benchmarks/peers/bench_attention_peers.py [--modes fwd,bwd] [--shapes all|8k|long|k] [--out DIR]

Forward: ours (TileLang) vs FlashMLA's sparse prefill (``flash_mla.flash_mla_sparse_fwd``, provider
``flashmla``). Backward: ours vs cuDNN frontend 1.32's DSA backward
(``cudnn.DSA.sparse_attention_backward_wrapper``, provider ``cudnn_fe``), both given the same out /
lse / dout. Each peer's outputs are compared with ours first (rel L2 <= 1e-2, NaN fails); a
disagreement is recorded in the row's error column and the peer is not timed. Rows (op, mode, shape,
provider, tflops, gpu, date, git, ...) are appended to ``benchmarks/results/kernels.csv``.

Inputs: one sequence (B 1), queries aligned to the end of the keys, each query picks k distinct
keys among its causal prefix (random, so every slot is valid once the prefix is long enough) -
the FLOPs are those of every slot (fwd 2*H*k*(Dqk+Dv), bwd 2*H*k*(2*Dv+3*Dqk) per query).
The peers take the packed layout ([S, H, D], [Skv, D]); ours is called with B = 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import AGREE, Rows, error_text, import_peer, rel_diff  # noqa: E402

# (op, S, Skv, H, Dqk, Dv, k, sink): the issues' target table
SHAPES_8K = [
    ("sparse_mla", 4096, 8192, 128, 576, 512, 2048, False),
    ("sparse_mla", 4096, 8192, 64, 576, 512, 2048, False),
    ("sparse_attention_sink", 4096, 8192, 128, 512, 512, 1024, True),
    ("sparse_attention_sink", 4096, 8192, 64, 512, 512, 512, True),
]
SHAPES_LONG = [("sparse_mla", 4096, skv, 128, 576, 512, 2048, False) for skv in (32768, 65536, 131072)]
# V4 H64 over k: the time per CTA against the slot blocks it walks splits into a fixed part (Q in,
# output out, the first gathers) and a part per block
SHAPES_K = [("sparse_attention_sink", 4096, 8192, 64, 512, 512, k, True) for k in (256, 512, 1024, 2048)]


def shape_name(s, skv, h, dqk, dv, k) -> str:
    return f"B1 S{s} Skv{skv} H{h} D{dqk}/{dv} k{k}"


def make_inputs(s, skv, h, dqk, dv, k, sink, seed=0):
    """q [1,S,H,Dqk], kv [1,Skv,Dqk] bf16, idx [1,S,k] int32 (distinct causal keys), z [H] fp32 or None."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, s, h, dqk, device="cuda", generator=g).bfloat16()
    kv = torch.randn(1, skv, dqk, device="cuda", generator=g).bfloat16()
    pos = torch.arange(s, device="cuda") + (skv - s)  # query i sees keys 0..pos[i]
    idx = torch.empty(s, k, device="cuda", dtype=torch.int32)
    for a in range(0, s, 512):  # distinct keys per row: top-k of random scores over the prefix
        r = torch.rand(min(512, s - a), skv, device="cuda", generator=g)
        r.masked_fill_(torch.arange(skv, device="cuda")[None] > pos[a:a + 512, None], -1.0)
        v, i = r.topk(k, dim=-1)
        idx[a:a + 512] = torch.where(v >= 0, i, -1).to(torch.int32)
    z = torch.randn(h, device="cuda", generator=g) if sink else None
    return q, kv, idx[None], z


def flashmla_forward(flash_mla, q, kv, idx, scale, dv, z):
    """FlashMLA's sparse prefill on our B = 1 inputs (it takes [S,H,D], [Skv,1,D], [S,1,k]):
    (out, max_logits, lse)."""
    return flash_mla.flash_mla_sparse_fwd(q[0], kv[0].unsqueeze(1), idx[0].unsqueeze(1), scale, dv, attn_sink=z)


def cudnn_backward(cudnn_dsa, q, kv, idx, out, lse, dout, scale, z):
    """cuDNN frontend's sm90 DSA backward on our B = 1 inputs: a dict with dq, dkv, d_sink."""
    # cuDNN takes a sink always: -inf is "no sink" (exp(-inf) = 0 adds nothing to the normaliser)
    z_peer = z if z is not None else torch.full((q.shape[2],), float("-inf"), device=q.device)
    return cudnn_dsa.sparse_attention_backward_wrapper(q=q[0], kv=kv[0], out=out[0], dout=dout[0], lse=lse[0],
                                                       attn_sink=z_peer, topk_idxs=idx[0], softmax_scale=scale)


def bench_forward(rows: Rows, shapes, flash_mla, variants=()) -> None:
    """``variants``: compile-time overrides of our forward (e.g. {"schedule": "seesaw"}), each timed
    as a ``tilelang`` row with the override in its variant column, after the default."""
    from dsa_plugins.kernels.sparse_attention_fwd import _launch, sparse_attention_fwd

    for op, s, skv, h, dqk, dv, k, sink in shapes:
        name, scale = shape_name(s, skv, h, dqk, dv, k), dqk ** -0.5
        flops = 2.0 * s * h * k * (dqk + dv)
        q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
        ours = lambda: sparse_attention_fwd(q, kv, idx, scale, sink=z, dv=dv)  # noqa: E731
        out, lse = ours()
        rows.time(op, "fwd", name, "tilelang", ours, flops)
        for over in variants:
            o2, l2 = torch.empty_like(out), torch.empty_like(lse)
            run = lambda: _launch(q, kv, idx, scale, z, dv, o2, l2, overrides=over)  # noqa: E731
            run()
            d_out, d_lse = rel_diff(o2, out), rel_diff(l2, lse)
            error = None if max(d_out, d_lse) <= AGREE else f"disagrees with the default: out {d_out:.2e} lse {d_lse:.2e}"
            rows.time(op, "fwd", name, "tilelang", run, flops, error=error, variant=json.dumps(over, sort_keys=True))
        if flash_mla is None:
            continue
        peer = lambda: flashmla_forward(flash_mla, q, kv, idx, scale, dv, z)  # noqa: E731
        error = None
        try:
            p_out, _, p_lse = peer()
            d_out, d_lse = rel_diff(p_out, out[0]), rel_diff(p_lse, lse[0])
            print(f"  flashmla vs ours: out {d_out:.2e}, lse {d_lse:.2e}", flush=True)
            if max(d_out, d_lse) > AGREE:
                error = f"disagrees with ours: out {d_out:.2e} lse {d_lse:.2e}"
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            error = error_text(exc)
        rows.time(op, "fwd", name, "flashmla", peer, flops, error=error)
        del q, kv, idx, out, lse


def bench_backward(rows: Rows, shapes, cudnn_dsa) -> None:
    from dsa_plugins.kernels.sparse_attention_bwd import bwd_flops, sparse_attention_bwd
    from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd

    for op, s, skv, h, dqk, dv, k, sink in shapes:
        name, scale = shape_name(s, skv, h, dqk, dv, k), dqk ** -0.5
        flops = bwd_flops(s, h, k, dqk, dv)
        q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
        out, lse = sparse_attention_fwd(q, kv, idx, scale, sink=z, dv=dv)
        dout = (0.1 * torch.randn_like(out))
        # dkv in kv's dtype, as the peer returns it and as the ops layer asks for it (the cast is timed)
        ours = lambda: sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=dv,  # noqa: E731
                                            dkv_dtype=kv.dtype)
        dq, dkv, dz = ours()
        rows.time(op, "bwd", name, "tilelang", ours, flops)
        rows.time(op, "bwd", name, "tilelang", lambda: sparse_attention_bwd(
            q, kv, idx, out, lse, dout, scale, sink=z, dv=dv, deterministic=True, dkv_dtype=kv.dtype), flops,
            variant="deterministic")
        rows.rows[-1]["provider"] = "tilelang_deterministic"
        if cudnn_dsa is None:
            continue
        peer = lambda: cudnn_backward(cudnn_dsa, q, kv, idx, out, lse, dout, scale, z)  # noqa: E731
        error = None
        try:
            res = peer()
            d = {"dq": rel_diff(res["dq"], dq[0]), "dkv": rel_diff(res["dkv"], dkv[0])}
            if z is not None:
                d["dsink"] = rel_diff(res["d_sink"], dz)
            print("  cudnn_fe vs ours: " + ", ".join(f"{n} {v:.2e}" for n, v in d.items()), flush=True)
            if max(d.values()) > AGREE:
                error = "disagrees with ours: " + " ".join(f"{n} {v:.2e}" for n, v in d.items())
        except Exception as exc:  # noqa: BLE001
            error = error_text(exc)
        rows.time(op, "bwd", name, "cudnn_fe", peer, flops, error=error)
        del q, kv, idx, out, lse, dout, dq, dkv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="fwd,bwd")
    ap.add_argument("--shapes", default="all", choices=["all", "8k", "long", "k"])
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--tag", default="kernels")
    ap.add_argument("--fwd-variants", default="[]",
                    help='JSON list of forward overrides to time beside the default, e.g. [{"schedule": "seesaw"}]')
    args = ap.parse_args(argv)
    shapes = {"all": SHAPES_8K + SHAPES_LONG, "8k": SHAPES_8K, "long": SHAPES_LONG, "k": SHAPES_K}[args.shapes]
    rows = Rows(args.tag, args.out)
    modes = args.modes.split(",")
    if "fwd" in modes:
        bench_forward(rows, shapes, import_peer("flash_mla", "flashmla"), json.loads(args.fwd_variants))
    if "bwd" in modes:
        cudnn = import_peer("cudnn", "cudnn_fe")
        bench_backward(rows, shapes, cudnn.DSA if cudnn is not None else None)
    rows.ratios()
    rows.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
