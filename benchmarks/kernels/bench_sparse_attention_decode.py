"""The forward of a generation step: one query per sequence, k selected keys from a long cache.

    python benchmarks/kernels/bench_sparse_attention_decode.py [--heads 64,128] [--batches 1,8,32,64,128]
        [--cache 32768,131072] [--out DIR]

Times CUDA-graph replay of ``sparse_attention_fwd`` (what a captured decode step runs): the default
one-CTA-per-row walk (variant ``one_part``) beside the split that DSA_PLUGINS_DECODE_PART_SLOTS turns
on (one-query rows cut into parts of ``--part-slots`` slots, scored by CTAs of their own and merged
by the combine program; variant ``split<n>``) and the split whose parts merge inside one cluster through
distributed shared memory (``--cluster-parts``; variant ``cluster<n>``). Bandwidth is counted on the bytes a step must read:
the selected kv rows (Dqk bf16 each), q and out. Rows go to ``benchmarks/results/attention_decode.csv``.
Shapes whose cache has 2**31 elements or more (a single launch's limit) are skipped.

Peer (576/512 only, when staged: ``../shared/device/stage_flashmla.sh``): FlashMLA's sparse decode
(``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``, provider ``flashmla``), which reads
an fp8 cache of 656 bytes per token (512 e4m3 values, 4 fp32 scales, the 64-wide rope part in bf16)
where ours reads 1152 bytes of bf16. Ours runs on that cache dequantised to bf16 (the same values:
e4m3 times a power of two is exact in bf16), so the two outputs must agree (rel <= 1e-2) before the
peer is timed, and each row's bandwidth counts the bytes that provider must read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peers"))
from common import AGREE, Rows, error_text, import_peer, rel_diff  # noqa: E402

from dsa_plugins.bench.runner import capture_graph, graph_replay_ms  # noqa: E402
from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch  # noqa: E402


def graph_us(fn, reps: int = 50) -> float:
    """Median-free mean over ``reps`` replays of one captured call, in microseconds."""
    graph = capture_graph(fn, warmup=3)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph_replay_ms(graph, reps) * 1e3


FP8_ROW_BYTES = 656  # FlashMLA's V3.2 fp8 cache: 512 e4m3 + 4 fp32 scales + 64 bf16 (rope)


def add_row(rows: Rows, shape: str, provider: str, variant: str, us: float, need: int, flops: float, peak: float):
    """One decode row: time per step, bandwidth on the bytes that provider must read, TFLOP/s."""
    row = {"op": "sparse_attention_decode", "mode": "fwd", "shape": shape, "provider": provider, "variant": variant,
           **rows.env, "median_ms": us / 1e3, "gbps": need / (us * 1e-6) / 1e9, "tflops": flops / (us * 1e-6) / 1e12}
    rows.rows.append(row)
    print(f"{shape:<40} {provider:<9} {variant:<9} {us:8.1f} us  {need / 1e6:7.1f} MB  "
          f"{need / (us * 1e-6) / 1e12:5.2f} TB/s ({100 * need / (us * 1e-6) / peak:4.1f}% of HBM)", flush=True)


def fp8_cache(kv: torch.Tensor, rows_per_chunk: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's fp8 sparse-decode cache of ``kv`` [N, 576] bf16, and the same values in bf16.

    Each 128-wide group of the 512 latent columns gets a power-of-two scale (its amax / 448 rounded
    up), the rope columns stay bf16. Returns (cache [N, 656] float8_e4m3fn, dequantised [N, 576] bf16),
    built in chunks of rows (the fp32 temporaries of a 4M-row cache would take 8 GiB)."""
    n = kv.shape[0]
    cache = torch.empty(n, FP8_ROW_BYTES, dtype=torch.uint8, device=kv.device)
    deq = torch.empty_like(kv)
    for a in range(0, n, rows_per_chunk):
        part = kv[a:a + rows_per_chunk]
        m = part.shape[0]
        nope = part[:, :512].float().view(m, 4, 128)
        scales = torch.exp2(torch.ceil(torch.log2((nope.abs().amax(-1) / 448.0).clamp_min(1e-4))))
        e4m3 = (nope / scales[..., None]).to(torch.float8_e4m3fn)
        cache[a:a + m, :512] = e4m3.view(torch.uint8).view(m, 512)
        cache[a:a + m, 512:528] = scales.contiguous().view(torch.uint8).view(m, 16)
        cache[a:a + m, 528:] = part[:, 512:].contiguous().view(torch.uint8).view(m, 128)
        deq[a:a + m, :512] = (e4m3.float() * scales[..., None]).view(m, 512).to(kv.dtype)
        deq[a:a + m, 512:] = part[:, 512:]
    return cache.view(torch.float8_e4m3fn), deq


def flashmla_decode(flash_mla, q, kv, idx, scale, sink, page: int = 64):
    """A callable running FlashMLA's fp8 sparse decode on the cache of ``kv`` [B, Skv, 576], and the
    dequantised kv [B, Skv, 576] ours must run on to compute the same function. The B caches are one
    pool of pages (sequence b's token t is pool row b * Skv + t), as a serving engine's paged cache."""
    b, skv, _ = kv.shape
    cache, deq = fp8_cache(kv.view(b * skv, -1))
    pool = cache.view(b * skv // page, page, 1, FP8_ROW_BYTES)
    offsets = (torch.arange(b, device=kv.device, dtype=torch.int32) * skv).view(b, 1, 1)
    pool_idx = torch.where(idx >= 0, idx + offsets, -1).to(torch.int32)
    meta, _ = flash_mla.get_mla_metadata()

    def run():
        return flash_mla.flash_mla_with_kvcache(q, pool, None, None, 512, meta, None, softmax_scale=scale,
                                                is_fp8_kvcache=True, indices=pool_idx, attn_sink=sink)

    return run, deq.view(b, skv, -1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--cache", default="32768")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--part-slots", default="512,1024")
    ap.add_argument("--cluster-parts", default="2,4,8", help="decode parts merged inside a cluster (variant cluster<n>)")
    ap.add_argument("--dims", default="576/512", help="Dqk/Dv (512/512 adds a sink, as DeepSeek-V4)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dqk, dv = (int(x) for x in args.dims.split("/"))
    sink_on = dqk == dv
    rows = Rows("attention_decode", args.out)
    peak = 3.35e12 if "H100" in torch.cuda.get_device_name() else 4.8e12  # nominal HBM3 / HBM3e bytes/s
    flash_mla = import_peer("flash_mla", "flashmla") if (dqk, dv) == (576, 512) else None
    gen = torch.Generator(device="cuda").manual_seed(0)
    for skv in (int(x) for x in args.cache.split(",")):
        for h in (int(x) for x in args.heads.split(",")):
            for b in (int(x) for x in args.batches.split(",")):
                if b * skv * dqk >= 2**31:
                    print(f"B{b} H{h} cache{skv}: skipped (a {b} x {skv} x {dqk} cache is one launch's limit)")
                    continue
                q = torch.randn(b, 1, h, dqk, device="cuda", generator=gen).bfloat16()
                kv = torch.randn(b, skv, dqk, device="cuda", generator=gen).bfloat16()
                idx = torch.stack([torch.randperm(skv, device="cuda", generator=gen)[: args.k] for _ in range(b)])
                idx = idx.int().view(b, 1, args.k)
                sink = torch.randn(h, device="cuda", generator=gen) if sink_on else None
                scale, _ = _check_inputs(q, kv, idx, dqk**-0.5, sink, dv)
                out = torch.empty(b, 1, h, dv, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(b, 1, h, device="cuda")
                need = b * args.k * dqk * 2 + b * h * (dqk + dv) * 2
                shape = f"B{b} H{h} D{dqk}/{dv} k{args.k} cache{skv}"
                flops = 2.0 * b * h * args.k * (dqk + dv)
                peer = None
                if flash_mla is not None:
                    peer, kv = flashmla_decode(flash_mla, q, kv, idx, scale, sink)
                variants = [("one_part", 0, 0)]
                variants += [(f"split{n}", int(n), 0) for n in args.part_slots.split(",") if n]
                variants += [(f"cluster{n}", 0, int(n)) for n in args.cluster_parts.split(",") if n]
                first = None
                for variant, slots, parts in variants:
                    fn = lambda: _launch(q, kv, idx, scale, sink, dv, out, lse, part_slots=slots,  # noqa: E731
                                         cluster_parts=parts)
                    fn()
                    if first is None:
                        first = (out.clone(), lse.clone())
                    else:  # every split agrees with the one-CTA walk before it is timed
                        d_out, d_lse = rel_diff(out, first[0]), rel_diff(lse, first[1])
                        if max(d_out, d_lse) > AGREE:
                            print(f"  {variant} disagrees with one_part: out {d_out:.2e}, lse {d_lse:.2e}", flush=True)
                            continue
                    add_row(rows, shape, "tilelang", variant, graph_us(fn), need, flops, peak)
                if peer is not None:
                    _launch(q, kv, idx, scale, sink, dv, out, lse, part_slots=0, cluster_parts=0)
                    peer_need = b * args.k * FP8_ROW_BYTES + b * h * (dqk + dv) * 2
                    try:
                        p_out, p_lse = peer()
                        d_out, d_lse = rel_diff(p_out, out), rel_diff(p_lse.transpose(1, 2), lse)
                        print(f"  flashmla vs ours: out {d_out:.2e}, lse {d_lse:.2e}", flush=True)
                        error = None if max(d_out, d_lse) <= AGREE else f"disagrees with ours: out {d_out:.2e} lse {d_lse:.2e}"
                    except Exception as exc:  # noqa: BLE001 - a refusal is a result
                        error = error_text(exc)
                    if error is None:
                        add_row(rows, shape, "flashmla", "fp8_cache", graph_us(peer), peer_need, flops, peak)
                    else:  # a row that says why the peer was not timed
                        rows.time("sparse_attention_decode", "fwd", shape, "flashmla", peer, flops, error=error,
                                  variant="fp8_cache")
                del q, kv, idx, out, lse, peer
                torch.cuda.empty_cache()
            rows.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
