"""How fast can a GPU scatter-add gathered fp32 rows? The floor under every d_index_k / dkv scatter.

    python benchmarks/kernels/bench_scatter_floor.py [--out DIR] [--t 8192] [--k 2048] [--dims 576,128]
                                                      [--modes red,red4,red4_keep,bulk]

Each CTA owns one query row of a causal top-k pattern ([T, k] int32, -1 past the prefix) and adds a
[64, D] fp32 tile, produced by a small wgmma as in the loss and attention backward programs, into
the rows of a [T, D] fp32 buffer named by the row's slots, 64 slots at a time. Two ways to send it:

- ``red``: red.global.add.v2.f32 straight from the accumulator registers (what the shipped
  programs do);
- ``bulk``: the tile staged in shared memory (double-buffered) and sent as one TMA bulk reduction
  (cp.reduce.async.bulk .add.f32) per row, issued by 32, 4 or 1 lanes;
- ``red4``: the tile staged in shared memory and sent as red.global.add.v4.f32 by every thread,
  consecutive lanes on consecutive 16 bytes of a row (a warp covers whole 128-byte lines: the
  shape cuDNN's Hopper DSA backward gives its dkv reductions);
- ``red4_keep``: the same with an L2 evict_last policy on each reduction (the accumulator lines stay
  in L2 while the gathered rows stream through).

Rows wider than 128 (the attention's 576-wide dkv) are sent in 64-column chunks, each its own
wgmma tile, as the attention backward does.

The adds per second this reaches is the rate at which L2 takes fp32 reductions; no program that
scatters T*k*D fp32 values can beat T*k*D / that rate. Writes DIR/scatter_floor.md and .csv.
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from dsa_plugins.bench.runner import median_ms  # noqa: E402

RED4_PRELUDE = r"""
__device__ __forceinline__ void bench_red_v4(const float* s, float* g) {
  float4 v = *reinterpret_cast<const float4*>(s);
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "l"(g), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
__device__ __forceinline__ void bench_red_v4_keep(const float* s, float* g) {
  float4 v = *reinterpret_cast<const float4*>(s);
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;"
               :: "l"(g), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "l"(policy) : "memory");
}
"""

BULK_PRELUDE = r"""
__device__ __forceinline__ void bench_bulk_add_f32(const float* smem, float* gmem, int bytes) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(gmem), "r"(s), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bench_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bench_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
"""


def scatter_program(dim: int, mode: str, issuers: int = 32, block: int = 64, threads: int = 128):
    """[T, kp] slots -> adds a synthetic wgmma tile per block of slots into Out[T_k, dim] (fp32)."""
    import tilelang.cuda.language as TC
    import tilelang.language as T

    NT, TK, KP = T.dynamic("n_rows, n_keys, kp")
    BK, D = block, min(dim, 128)  # the wgmma tile; wider rows go out in 64-column chunks
    if dim > 128:
        D = 64
        assert dim % 64 == 0
    chunks = tuple(range(dim // D))
    rows_per_lane = BK // issuers
    prelude = {"bulk": BULK_PRELUDE, "red4": RED4_PRELUDE, "red4_keep": RED4_PRELUDE}.get(mode)
    red4 = "bench_red_v4_keep" if mode == "red4_keep" else "bench_red_v4"
    per_thread4 = BK * D // 4 // threads

    @T.prim_func
    def main(Idx: T.Tensor([NT, KP], "int32"), Seed: T.Tensor([NT], "float32"), Out: T.Tensor([TK, dim], "float32")):
        with TC.Kernel(NT, threads=threads, prelude=prelude) as bx:
            acc = T.alloc_fragment([BK, D], "float32")
            a_s = T.alloc_shared([BK, 64], "bfloat16")
            b_s = T.alloc_shared([64, D], "bfloat16")
            tx = T.get_thread_binding()
            for j, h in T.Parallel(BK, 64):
                a_s[j, h] = T.cast(Seed[bx] + j * 0.01 - h * 0.02, "bfloat16")
            for h, d in T.Parallel(64, D):
                b_s[h, d] = T.cast(Seed[bx] * 0.5 + d * 0.01 - h * 0.03, "bfloat16")
            if mode != "red":
                stages = (T.alloc_shared([BK * D], "float32"), T.alloc_shared([BK * D], "float32"))
            for t in T.serial(KP // BK // 2):
                for s, c in [(s_, c_) for s_ in (0, 1) for c_ in chunks]:
                    b = 2 * t + s
                    c0 = c * D
                    T.gemm(a_s, b_s, acc, clear_accum=True)  # the accumulator layout of the real programs
                    if mode == "red":
                        for j, d in T.Parallel(BK, D):
                            if Idx[bx, b * BK + j] >= 0:
                                T.atomic_add(Out[Idx[bx, b * BK + j], c0 + d], acc[j, d])
                    elif mode in ("red4", "red4_keep"):
                        stage = stages[(s * len(chunks) + c) % 2]
                        for j, d in T.Parallel(BK, D):
                            stage[j * D + d] = acc[j, d]
                        T.sync_threads()
                        for i in T.unroll(per_thread4):
                            flat = i * threads + tx
                            row = flat // (D // 4)
                            col = (flat % (D // 4)) * 4
                            if Idx[bx, b * BK + row] >= 0:
                                T.call_extern("handle", red4, T.access_ptr(stage[row * D + col], "r", 4),
                                              T.access_ptr(Out[Idx[bx, b * BK + row], c0 + col], "w", 4))
                    else:
                        if tx < issuers:
                            T.call_extern("handle", "bench_bulk_wait_read<1>")  # the stage of two sends ago was read
                        T.sync_threads()
                        stage = stages[(s * len(chunks) + c) % 2]  # consecutive sends alternate
                        for j, d in T.Parallel(BK, D):
                            stage[j * D + d] = acc[j, d]
                        T.fence_proxy_async()
                        T.sync_threads()
                        if tx < issuers:
                            for r in T.unroll(rows_per_lane):
                                row = tx * rows_per_lane + r
                                if Idx[bx, b * BK + row] >= 0:
                                    T.call_extern("handle", "bench_bulk_add_f32",
                                                  T.access_ptr(stage[row * D], "r", D),
                                                  T.access_ptr(Out[Idx[bx, b * BK + row], c0], "w", D), D * 4)
                            T.call_extern("handle", "bench_bulk_commit")
            if mode == "bulk" and tx < issuers:
                T.call_extern("handle", "bench_bulk_wait_read<0>")

    return main


VARIANTS = (("red", 32), ("red4", 32), ("red4_keep", 32), ("bulk", 32), ("bulk", 4), ("bulk", 1))
DIMS = (128, 64, 576)  # indexer loss d_index_k (Di 128, 64); attention dkv (576, in 64-column chunks)


def build(target, dims=DIMS, variants=VARIANTS):
    import tilelang

    return {(d, m, i): tilelang.compile(scatter_program(d, m, i), target=target, out_idx=None)
            for d in dims for m, i in variants}


def causal_topk(t, k, dev):
    r = torch.rand(t, t, device=dev)
    r = r.masked_fill(torch.arange(t, device=dev)[None] > torch.arange(t, device=dev)[:, None], -1.0)
    vals, idx = torch.topk(r, k, dim=1)
    return torch.where(vals >= 0, idx, -1).to(torch.int32).contiguous()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--dims", default=",".join(map(str, DIMS)), help="comma list of row widths")
    ap.add_argument("--modes", default=",".join(sorted({m for m, _ in VARIANTS})), help="comma list of modes")
    args = ap.parse_args(argv)
    dev = "cuda"
    dims = tuple(int(d) for d in args.dims.split(","))
    variants = tuple(v for v in VARIANTS if v[0] in args.modes.split(","))
    kernels = build({"kind": "cuda", "arch": "sm_90a"}, dims, variants)
    torch.manual_seed(0)
    idx = causal_topk(args.t, args.k, dev)
    seed = torch.rand(args.t, device=dev)
    n_valid = int((idx >= 0).sum())
    rows = []
    for d in dims:
        ref = None
        for m, i in variants:
            kern = kernels[(d, m, i)]
            out = torch.zeros(args.t, d, device=dev)
            kern(idx, seed, out)
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            diff = ((out - ref).norm() / ref.norm()).item()
            ms = median_ms(lambda: kern(idx, seed, out))
            gadds = n_valid * d / 1e9
            rows.append({"dim": d, "mode": m, "issuers": i if m == "bulk" else "", "ms": round(ms, 4),
                         "g_adds": round(gadds, 3), "g_adds_per_ms": round(gadds / ms, 3),
                         "tb_per_s": round(gadds * 4 / ms, 3), "rel_diff_vs_red": f"{diff:.1e}"})
            print(rows[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "scatter_floor.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    with open(os.path.join(args.out, "scatter_floor.md"), "w") as f:
        f.write(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; causal top-k T {args.t}, k {args.k} "
                f"({n_valid} valid slots), fp32 rows, median ms\n\n"
                "| D | mode | issuing lanes | ms | G adds | G adds/ms | TB/s of fp32 |\n|---|---|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['dim']} | {r['mode']} | {r['issuers']} | {r['ms']:.3f} | {r['g_adds']:.2f} | "
                    f"{r['g_adds_per_ms']:.2f} | {r['tb_per_s']:.2f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
