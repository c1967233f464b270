"""Benchmark (and compile warm-up) of the TileLang sparse attention backward.

    python benchmarks/kernels/bench_sparse_attention_bwd.py --warmup [--jobs 16] [--shapes ...]   # compile in parallel
    python benchmarks/kernels/bench_sparse_attention_bwd.py [--csv out.csv] [--variants JSON]
    (a variant {"deterministic": true, ...} times that mode only, e.g. {"deterministic": true,
    "det_mode": "fixed"} beside the default --det rows)

FLOPs = 2 * B * S * H * K * (2 * Dv + 3 * Dqk) (all K slots counted). Times are medians of
triton.testing.do_bench (CUDA events fallback) on random inputs; out/lse come from a chunked
torch forward in fp32.
"""

import argparse
import concurrent.futures as cf
import csv
import functools
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch

TARGET = {"kind": "cuda", "arch": "sm_90a"}

# (name, B, S, Skv, H, Dqk, Dv, K, sink); a "_causal" name: query s selects among keys 0..s
# (Skv = S), -1 after its min(s + 1, K) valid slots, and TFLOP/s are also given on valid pairs
SHAPES = [
    ("mla_h64", 1, 4096, 8192, 64, 576, 512, 2048, False),
    ("mla_h128", 1, 4096, 8192, 128, 576, 512, 2048, False),
    ("v4_h128_sink", 1, 4096, 8192, 128, 512, 512, 1024, True),
    ("v4_h64_sink", 1, 4096, 8192, 64, 512, 512, 512, True),
    ("mla_h64_causal", 1, 4096, 4096, 64, 576, 512, 2048, False),
    ("mla_h128_causal", 1, 4096, 4096, 128, 576, 512, 2048, False),
]
# long caches (issue 12's Skv 32K-128K rows): named with --shapes, not in the default run (work that does not grow
# with Skv beside per-kv-row passes that do, e.g. restoring dkv's column order after ws_dkv_perm)
LONG_SHAPES = [(f"mla_h128_skv{n}k", 1, 4096, n * 1024, 128, 576, 512, 2048, False) for n in (32, 64, 128)]


def _test_configs():
    from tests.kernels.test_sparse_attention_bwd_gpu import CONFIGS

    return [{"heads": h, "dqk": dqk, "dv": dv, "has_sink": sk, "dtype": str(dt).replace("torch.", "")}
            for h, dqk, dv, sk, dt in CONFIGS]


def _jobs(configs):
    """configs: list of (config dict, with deterministic programs)."""
    from dsa_plugins.kernels import sparse_attention_bwd as m

    jobs = []
    for c, with_det in configs:
        cfg = m._normalise_config(c)
        for name in m.bwd_program_names(cfg):  # the benchmark times no head-summed P output
            if not name.endswith("_probs") and (with_det or name in ("preprocess", "main")):
                jobs.append(m._program_key(cfg, name))
    out = []
    for j in jobs:
        if j not in out:
            out.append(j)
    return out


def _compile_one(job):
    from dsa_plugins.kernels import sparse_attention_bwd as m

    t = time.time()
    try:
        m._get(job[0], TARGET, *job[1])
        return job, time.time() - t, None
    except Exception as exc:  # noqa: BLE001 - report, keep going
        return job, time.time() - t, f"{type(exc).__name__}: {str(exc)[-2000:]}"


def warmup(configs, jobs_n):
    jobs = _jobs(configs)
    t0 = time.time()
    bad = 0
    with cf.ProcessPoolExecutor(max_workers=jobs_n, mp_context=mp.get_context("spawn")) as ex:
        for job, dt, err in ex.map(_compile_one, jobs):
            print(f"compiled {job} in {dt:.1f}s" + (f" FAILED {err}" if err else ""), flush=True)
            bad += err is not None
    print(f"warmup: {len(jobs)} programs in {time.time() - t0:.1f}s, {bad} failed", flush=True)
    return bad


def _bench(fn):
    from dsa_plugins.bench.runner import median_ms

    return median_ms(fn)


def make_inputs(B, S, Skv, H, Dqk, Dv, K, sink, seed=0, causal=False):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    dt = torch.bfloat16
    q = torch.randn(B, S, H, Dqk, generator=g, device="cuda").to(dt)
    kv = torch.randn(B, Skv, Dqk, generator=g, device="cuda").to(dt)
    dout = (0.1 * torch.randn(B, S, H, Dv, generator=g, device="cuda")).to(dt)
    rows = []
    for _ in range(B):
        r = torch.rand(S, Skv, generator=g, device="cuda")
        if causal:  # future keys rank last and become -1
            r = r.masked_fill(torch.ones(S, Skv, device="cuda", dtype=torch.bool).triu(1), -1.0)
        rows.append(r.topk(K, -1).indices)
    idx = torch.stack(rows).to(torch.int32)
    if causal:
        valid = torch.arange(K, device="cuda")[None, :] <= torch.arange(S, device="cuda")[:, None]
        idx = torch.where(valid[None], idx, -1)
    z = torch.randn(H, generator=g, device="cuda").float() if sink else None
    scale = Dqk ** -0.5
    out = torch.empty(B, S, H, Dv, device="cuda", dtype=dt)
    lse = torch.empty(B, S, H, device="cuda", dtype=torch.float32)
    c = 128
    for b in range(B):
        for s0 in range(0, S, c):
            qc = q[b, s0:s0 + c].float()
            ic = idx[b, s0:s0 + c].long()
            kvg = kv[b][ic.clamp(min=0)].float()  # [c, K, D]
            sc = torch.einsum("chd,ckd->chk", qc, kvg) * scale
            sc = sc.masked_fill((ic < 0)[:, None, :], float("-inf"))
            l = torch.logsumexp(sc, -1)
            norm = l if z is None else torch.logaddexp(l, z.view(1, H))
            p = torch.exp(sc - norm[..., None])
            out[b, s0:s0 + c] = torch.einsum("chk,ckd->chd", p, kvg[..., :Dv]).to(dt)
            lse[b, s0:s0 + c] = l
    return q, kv, idx, out, lse, dout, z, scale


PROFILE = False


def _profile(fn, label, calls=3):
    """Per-kernel GPU time of ``calls`` calls under torch.profiler (ms per call, largest first)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:70]] = times.get(ev.name[:70], 0.0) + ev.device_time_total / 1e3 / calls
    print(f"profile {label}: " + "; ".join(f"{k} {v:.3f} ms" for k, v in
                                          sorted(times.items(), key=lambda kv: -kv[1])[:8]), flush=True)


def _bench_shape(m, name, shape, variants, det, rows):
    sname, B, S, Skv, H, Dqk, Dv, K, sink = shape
    q, kv, idx, out, lse, dout, z, scale = make_inputs(B, S, Skv, H, Dqk, Dv, K, sink, causal="causal" in sname)
    flops = m.bwd_flops(B * S, H, K, Dqk, Dv)
    valid_share = (idx >= 0).float().mean().item()  # FLOPs on valid pairs = flops * valid_share
    base = m.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv)
    torch.cuda.synchronize()

    def run(deterministic, config):
        return m.sparse_attention_bwd(q, kv, idx, out, lse, dout, scale, sink=z, dv=Dv,
                                      deterministic=deterministic, config=config)

    def diff(res):
        return max(((a.float() - b.float()).norm() / b.float().norm()).item()
                   for a, b in zip(res, base, strict=True) if a is not None)

    for var in variants:
        if var.get("only") and var["only"] != sname:
            continue
        var = {k: v for k, v in var.items() if k != "only"}
        forced = var.pop("deterministic", None)  # a variant may time one mode only
        for d in ([forced] if forced is not None else [False, True] if (det and not var) else [False]):
            cfg = var or None
            try:
                err = diff(run(d, cfg))
                torch.cuda.synchronize()
                ms = _bench(functools.partial(run, d, cfg))
            except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
                print(f"{sname} det={d} var={var}: FAILED {type(exc).__name__}: {str(exc)[-1500:]}", flush=True)
                continue
            if PROFILE:
                _profile(functools.partial(run, d, cfg), f"{sname} det={d} var={json.dumps(var)}")
            tf = flops / ms / 1e9
            print(f"{name} | {sname} det={d} var={json.dumps(var)} | {ms:.3f} ms | {tf:.1f} TFLOP/s"
                  f" ({tf * valid_share:.1f} on valid pairs, {valid_share:.0%} of slots valid)"
                  f" | rel diff vs default {err:.1e}", flush=True)
            rows.append({"gpu": name, "shape": sname, "deterministic": d, "variant": json.dumps(var),
                         "ms": round(ms, 4), "tflops": round(tf, 1), "valid_tflops": round(tf * valid_share, 1)})


def bench(shapes, variants, csv_path, det):
    from dsa_plugins.kernels import sparse_attention_bwd as m

    name = torch.cuda.get_device_name()
    rows = []
    for shape in shapes:
        _bench_shape(m, name, shape, variants, det, rows)
        torch.cuda.empty_cache()
    if csv_path and rows:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--variants", default="[{}]", help="JSON list of config overrides")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--det", action="store_true", help="also time deterministic mode")
    ap.add_argument("--shapes", default=None, help="comma list of shape names")
    ap.add_argument("--profile", action="store_true", help="also print each run's per-kernel GPU times")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    variants = json.loads(args.variants)
    if args.warmup:
        # with --shapes: only what those shapes' runs need (the default, which every run is compared with, and each
        # variant); else also every GPU test configuration
        cfgs = [] if args.shapes else [(c, True) for c in _test_configs()]
        wanted = set(args.shapes.split(",")) if args.shapes else None
        known = SHAPES + LONG_SHAPES
        if wanted and wanted - {s[0] for s in known}:
            sys.exit(f"unknown shapes {sorted(wanted - {s[0] for s in known})}; known: {[s[0] for s in known]}")
        for _, B, S, Skv, H, Dqk, Dv, K, sink in (known if wanted else SHAPES):
            if wanted and _ not in wanted:
                continue
            if wanted:
                cfgs.append(({"heads": H, "dqk": Dqk, "dv": Dv, "has_sink": sink, "dtype": "bfloat16"}, args.det))
            for var in variants:
                if var.get("only") and var["only"] != _:
                    continue
                var = {k: v for k, v in var.items() if k != "only"}
                forced = var.pop("deterministic", None)
                cfgs.append(({"heads": H, "dqk": Dqk, "dv": Dv, "has_sink": sink, "dtype": "bfloat16", **var},
                             bool(forced) or not var))
        sys.exit(1 if warmup(cfgs, args.jobs) else 0)
    shapes = SHAPES if not args.shapes else [s for s in SHAPES + LONG_SHAPES if s[0] in args.shapes.split(",")]
    bench(shapes, variants, args.csv, args.det)


if __name__ == "__main__":
    main()
