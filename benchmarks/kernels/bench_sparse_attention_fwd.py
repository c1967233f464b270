"""Scratch driver: time the sparse attention forward kernel on the target shapes.

    python benchmarks/kernels/bench_sparse_attention_fwd.py [--quick] [--csv out.csv]

FLOPs per query token are counted over all K slots: 2 * H * K * (Dqk + Dv).
"""

import argparse
import csv
import functools
import sys

import torch

from dsa_plugins.bench.runner import median_ms  # noqa: E402


def bench_ms(fn, warmup=5, rep=30):
    return median_ms(fn)

SHAPES = [
    # name, B, S, Skv, H, Dqk, Dv, K, sink
    ("mla_v32", 1, 4096, 8192, 128, 576, 512, 2048, False),
    ("v4_sink", 1, 4096, 8192, 128, 512, 512, 1024, True),
    ("mla_glm5_h64", 1, 4096, 8192, 64, 576, 512, 2048, False),
    ("v4_sink_h64", 1, 4096, 8192, 64, 512, 512, 1024, True),
    ("mla_v32_skv32k", 1, 4096, 32768, 128, 576, 512, 2048, False),
    ("mla_v32_skv64k", 1, 4096, 65536, 128, 576, 512, 2048, False),
    ("mla_v32_skv128k", 1, 4096, 131072, 128, 576, 512, 2048, False),
    ("v4_sink_skv32k", 1, 4096, 32768, 128, 512, 512, 1024, True),
    ("v4_sink_skv64k", 1, 4096, 65536, 128, 512, 512, 1024, True),
    ("v4_sink_skv128k", 1, 4096, 131072, 128, 512, 512, 1024, True),
    ("mla_h32_tp", 1, 4096, 8192, 32, 576, 512, 2048, False),
    ("mla_h16_tp", 1, 4096, 8192, 16, 576, 512, 2048, False),
    # "_causal": query s names min(s + 1, K) keys among 0..s, then -1 (Skv = S); TFLOP/s also on valid pairs
    ("mla_glm5_h64_causal", 1, 4096, 4096, 64, 576, 512, 2048, False),
    ("mla_v32_causal", 1, 4096, 4096, 128, 576, 512, 2048, False),
]


PRECOMPILE = [
    dict(dim_qk=512, dim_v=512, has_sink=True),
    dict(dim_qk=576, dim_v=512, has_sink=False),
    dict(dim_qk=64, dim_v=64, has_sink=True),
    dict(dim_qk=64, dim_v=64, has_sink=False),
    dict(dim_qk=96, dim_v=64, has_sink=False),
    dict(dim_qk=576, dim_v=512, has_sink=False, dtype="float16"),
]
SCHEDULES = ("qk_one", "split", "qk_one_async")


def _compile_one(cfg):
    import time

    from dsa_plugins.kernels.sparse_attention_fwd import DEFAULT_CONFIG, build_fwd_kernel

    t = time.time()
    build_fwd_kernel({**DEFAULT_CONFIG, **cfg}, target={"kind": "cuda", "arch": "sm_90a"})
    return f"{cfg} {time.time() - t:.1f}s"


def precompile(configs=PRECOMPILE, jobs=14):
    """Fill TileLang's disk cache in parallel processes (the wrapper then loads from it)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    configs = [{**c, "schedule": sch} for c in configs for sch in SCHEDULES]
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        for fut in cf.as_completed([ex.submit(_compile_one, c) for c in configs]):
            try:
                print("compiled", fut.result(), flush=True)
            except Exception as exc:  # report and go on: the tests will show what is missing
                print("compile failed:", repr(exc)[:2000], flush=True)


def main(argv=None):
    from dsa_plugins.kernels.sparse_attention_fwd import _launch, sparse_attention_fwd

    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true", help="compile the test/bench configs and exit")
    ap.add_argument("--quick", action="store_true", help="only the two headline shapes")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--schedules", default="default", help="comma-separated schedules, or 'default'")
    ap.add_argument("--skip-tail", action="store_true", help="also time each schedule with skip_tail")
    args = ap.parse_args(argv)
    if args.precompile:
        precompile()
        return [True]
    shapes = SHAPES[:2] if args.quick else SHAPES
    if args.only:
        keep = set(args.only.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    gpu = torch.cuda.get_device_name()
    rows = []
    for name, b, s, skv, h, dqk, dv, k, has_sink in shapes:
        torch.manual_seed(0)
        q = torch.randn(b, s, h, dqk, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(b, skv, dqk, device="cuda", dtype=torch.bfloat16)
        idx = torch.randint(0, skv, (b, s, k), device="cuda", dtype=torch.int32)
        if name.endswith("_causal"):
            pos = torch.arange(s, device="cuda").view(1, s, 1)
            idx = torch.where(torch.arange(k, device="cuda") <= pos, idx % (pos + 1), -1).int()
        valid_share = (idx >= 0).float().mean().item()
        sink = torch.randn(h, device="cuda", dtype=torch.float32) if has_sink else None
        scale = dqk**-0.5
        runs = [(sch, False) for sch in args.schedules.split(",")]
        runs += [(sch, True) for sch in args.schedules.split(",")] if args.skip_tail else []
        for sched, skip in runs:
            if sched == "default" and not skip:
                fn = functools.partial(sparse_attention_fwd, q, kv, idx, scale, sink=sink, dv=dv)
            else:
                out = torch.empty(b, s, h, dv, device="cuda", dtype=torch.bfloat16)
                lse = torch.empty(b, s, h, device="cuda", dtype=torch.float32)
                over = {"skip_tail": skip, **({} if sched == "default" else {"schedule": sched})}
                fn = functools.partial(_launch, q, kv, idx, scale, sink, dv, out, lse, over)
            label = sched + ("+skip" if skip else "")
            fn()
            torch.cuda.synchronize()
            ms = bench_ms(fn)
            flops = 2.0 * b * s * h * k * (dqk + dv)
            tflops = flops / (ms * 1e-3) / 1e12
            row = dict(shape=name, schedule=label, gpu=gpu, B=b, S=s, Skv=skv, H=h, Dqk=dqk, Dv=dv, K=k,
                       sink=has_sink, ms=round(ms, 4), tflops=round(tflops, 1),
                       valid_tflops=round(tflops * valid_share, 1))
            rows.append(row)
            print(f"{name:18s} {label:12s} B{b} S{s} Skv{skv} H{h} {dqk}/{dv} K{k} sink={has_sink}: {ms:.3f} ms  "
                  f"{tflops:.1f} TFLOP/s ({tflops * valid_share:.1f} on valid pairs)  [{gpu}]", flush=True)
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
