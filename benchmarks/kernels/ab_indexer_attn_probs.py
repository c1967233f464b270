"""A/B of the indexer loss's attn_probs program (the standalone loss's target: head-summed attention
probabilities of the selected slots), variants compiled side by side and timed on the same inputs.

    python benchmarks/kernels/ab_indexer_attn_probs.py [--t 8192,32768] [--variants JSON] [--csv FILE]

Variants: JSON list of {"gather": "sync" | "chunked", "threads": int, "chunk": int, "stages": int} (chunk
and stages: the chunked layout's column chunk and buffers); each is checked
against the first (max abs difference of P) and timed (triton do_bench median, L2 flushed). Inputs:
H 64, Dqk 576, k 2048, causal rows (slots past a row's prefix are -1), attn_lse given and not.
"""

import argparse
import csv
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from dsa_plugins.bench.runner import median_ms  # noqa: E402
from dsa_plugins.kernels import indexer_loss as L  # noqa: E402

DEFAULT = [{"gather": "sync"}, {"gather": "chunked"}]


def compile_variant(v, dim, lse_pass, target):
    import tilelang

    prog = L._attn_probs_program(dim, lse_pass, threads=v.get("threads", L.THREADS), gather=v["gather"],
                                 chunk=v.get("chunk"), stages=v.get("stages"))
    return tilelang.compile(prog, target=target, pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
                            compile_flags=["-O3", "-DNDEBUG"])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", default="8192,32768")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--dim", type=int, default=576)
    ap.add_argument("--variants", default=json.dumps(DEFAULT))
    ap.add_argument("--csv", default=None)
    ap.add_argument("--lse-pass", default="0,1", help="which programs: 0 (attn_lse given), 1 (lse pass)")
    args = ap.parse_args(argv)
    variants = json.loads(args.variants)
    dev = torch.device("cuda")
    target = L._device_target(dev)
    passes = [bool(int(x)) for x in args.lse_pass.split(",")]
    # the lse pass has the "sync" layout only
    jobs = [(i, lp) for i in range(len(variants)) for lp in passes if not (lp and variants[i]["gather"] == "chunked")]
    with ThreadPoolExecutor(len(jobs)) as ex:
        progs = dict(zip(jobs, ex.map(lambda j: compile_variant(variants[j[0]], args.dim, j[1], target), jobs)))
    name = torch.cuda.get_device_name()
    rows = []
    for t in (int(x) for x in args.t.split(",")):
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(t, args.h, args.dim, device=dev, generator=g).bfloat16()
        kv = torch.randn(t, args.dim, device=dev, generator=g).bfloat16()
        ar = torch.arange(t, device=dev)
        idx = (torch.rand(t, args.k, device=dev, generator=g) * (ar + 1)[:, None]).long()
        idx = torch.where(torch.arange(args.k, device=dev)[None] <= ar[:, None], idx, -1).int()
        idx, _, kp = L._slots(idx, t)
        scale = args.dim ** -0.5
        lse = torch.randn(t, args.h, device=dev, generator=g) + 8.0
        sink = torch.full((args.h,), float("-inf"), device=dev)
        nhb = -(-args.h // L.BLOCK_H)
        for lp in passes:
            ref = None
            for i, v in enumerate(variants):
                if (i, lp) not in progs:
                    continue
                P = torch.empty(nhb, t, kp, device=dev)
                fn = lambda: progs[(i, lp)](q, kv, idx, lse, sink, scale, P)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                diff = 0.0 if ref is None else (P - ref).abs().max().item()
                if ref is None:
                    ref = P.clone()
                ms = median_ms(fn)
                label = json.dumps(v, sort_keys=True)
                print(f"T {t:6d} lse_pass {int(lp)} {label:50s} {ms:8.3f} ms  max|dP| vs first {diff:.2e}", flush=True)
                rows.append({"t": t, "lse_pass": int(lp), "variant": label, "ms": round(ms, 4), "max_diff": diff,
                             "gpu": name})
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
