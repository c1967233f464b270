"""Probe: the deterministic backward's reduce (``kernels/contrib_reduce.py``) reading its contribution rows where the
main program stores them today (query-row order: each kv row's rows scattered over the buffer) against the same
rows laid out in kv-row order (each kv row's rows one contiguous range), timing only.

    python benchmarks/kernels/probe_reduce_layout.py [--queries 800] [--kp 2048] [--skv 8192] [--nhb 1]

One chunk of the default 2 GiB budget at MLA H64 (800 query rows x 2048 slots, 576 columns). The sorted layout is
the same rows gathered into the slots' sorted order, so each kv row's sum is formed from the same values in the
same order: the probe checks the two sums bit for bit before it times them. Printed per contribution dtype: ms per
reduce in each layout (CUDA graphs, interleaved rounds), GB/s on the rows' bytes, and a plain streaming read of the
buffer (``torch.amax``) as the HBM reference. ``--warps``: the shipped layout's reduce with other CTA sizes.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=800)
    ap.add_argument("--kp", type=int, default=2048)
    ap.add_argument("--skv", type=int, default=8192)
    ap.add_argument("--dqk", type=int, default=576)
    ap.add_argument("--nhb", type=int, default=1, help="contribution rows per slot (head blocks, or their pairs)")
    ap.add_argument("--dtypes", default="int16,bfloat16,float32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--warps", default="", help="also time the shipped layout's reduce with these warps per CTA (4 ships)")
    args = ap.parse_args(argv)

    from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, ratio_text
    import tilelang

    from dsa_plugins.kernels.contrib_reduce import build_reduce, reduce_body, slot_order
    from dsa_plugins.kernels.sparse_attention_bwd import runtime_target

    dev = torch.device("cuda")
    target = runtime_target(dev)
    tq, kp, n, d, nhb = args.queries, args.kp, args.skv, args.dqk, args.nhb
    torch.manual_seed(0)
    # distinct kv rows per query row, as a top-k gives
    idx = torch.rand(tq, n, device=dev).topk(kp, dim=1).indices.int().contiguous()
    rows = torch.empty(tq * kp, device=dev, dtype=torch.int32)
    rowptr = torch.empty(n + 1, device=dev, dtype=torch.int32)
    slot_order(idx, n, kp, nhb, rows, rowptr)
    # the sorted layout: sorted slot i's rows at i * nhb + hb (the reduce reads rows base + hb * kp: base i * nhb, kp 1)
    rows_sorted = torch.arange(tq * kp, device=dev, dtype=torch.int32) * nhb
    gather = (rows.long().view(-1, 1) + kp * torch.arange(nhb, device=dev).view(1, -1)).reshape(-1)
    for name in args.dtypes.split(","):
        dt = getattr(torch, name)
        m = tq * nhb * kp
        if dt == torch.int16:
            contrib = torch.randint(-16384, 16385, (m, d), device=dev, dtype=torch.int16)
            exps = torch.randint(100, 130, (m, d // 8), device=dev, dtype=torch.uint8)
            red = build_reduce(d, nhb, "int16", 8, d % 16 == 0, target=target)
        else:
            contrib = torch.randn(m, d, device=dev, dtype=dt)
            exps = torch.zeros(1, device=dev, dtype=torch.uint8)
            red = build_reduce(d, nhb, name, target=target)
        contrib_sorted = contrib[gather].contiguous()
        exps_sorted = exps[gather].contiguous() if dt == torch.int16 else exps
        dkv_a = torch.zeros(n, d, device=dev, dtype=torch.float32)
        dkv_b = torch.zeros(n, d, device=dev, dtype=torch.float32)
        red(contrib, exps, rows, rowptr, dkv_a, kp)
        red(contrib_sorted, exps_sorted, rows_sorted, rowptr, dkv_b, 1)
        torch.cuda.synchronize()
        same = torch.equal(dkv_a, dkv_b) and bool(torch.isfinite(dkv_a).all())
        sink = torch.zeros((), device=dev, dtype=torch.float32)
        flat = contrib_sorted.view(torch.float16) if contrib_sorted.element_size() == 2 else contrib_sorted
        graphs = [capture_graph(lambda: red(contrib, exps, rows, rowptr, dkv_a, kp)),
                  capture_graph(lambda: red(contrib_sorted, exps_sorted, rows_sorted, rowptr, dkv_b, 1)),
                  capture_graph(lambda: sink.copy_(flat.amax().float()))]
        warps = [int(w) for w in args.warps.split(",") if w]
        for w in warps:  # the shipped layout, another CTA size (the same sums in another warp split: not compared)
            block, perm = (8, d % 16 == 0) if dt == torch.int16 else (8, False)
            other = tilelang.jit(target=target)(reduce_body)(d, nhb, name, block, perm, warps=w)
            graphs.append(capture_graph(lambda other=other: other(contrib, exps, rows, rowptr, dkv_a, kp)))
        times = interleaved_graph_ms(graphs, args.rounds, args.replays)
        nbytes = contrib.numel() * contrib.element_size() + (exps.numel() if dt == torch.int16 else 0)
        med = [statistics.median(t) for t in times]
        print(f"{name:9s} rows {m} x {d} ({nbytes / 1e9:.2f} GB) same bits {same}: scattered {med[0]:.3f} ms "
              f"({nbytes / med[0] / 1e6:.0f} GB/s), sorted {med[1]:.3f} ms ({nbytes / med[1] / 1e6:.0f} GB/s), "
              f"streaming read (amax) {med[2]:.3f} ms ({nbytes / med[2] / 1e6:.0f} GB/s); scattered / sorted {ratio_text(times[0], times[1])}", flush=True)
        for w, t in zip(warps, times[3:]):
            print(f"{name:9s} shipped layout, {w} warps per CTA: {statistics.median(t):.3f} ms "
                  f"({nbytes / statistics.median(t) / 1e6:.0f} GB/s); 4 warps / {w} warps {ratio_text(times[0], t)}",
                  flush=True)
        del contrib, contrib_sorted, graphs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
