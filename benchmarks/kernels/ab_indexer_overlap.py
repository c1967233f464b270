"""Indexer + top-k with each chunk's top-k on a second stream, under the next chunk's scores (issue 14).

    python benchmarks/kernels/ab_indexer_overlap.py [--T 8192,32768] [--chunks 2,4,8] [--rounds 7] [--replays 10]

Today the top-k of a chunk starts when the whole chunk's scores are written: one chunk at T 8K, so the score
program (tensor cores) and the radix select (shared-memory histograms and barriers) never run at the same time.
Here the query blocks are cut into ``n`` chunks of about equal causal work, scored last rows first on the
current stream; each chunk's top-k runs on a side stream as soon as its scores are complete, beside the next
chunk's scores. The last chunk scored holds the first rows, whose windows are short (rows of at most k keys
take every key), so the top-k left exposed at the end is cheap.

Every variant is captured in a CUDA graph and timed in alternating rounds beside the shipped path
(``indexer_topk``); the sets are checked equal to the shipped path's. Prints the median times and the
shipped / variant ratio per round (> 1: the variant is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_indexer import inputs as causal_inputs  # noqa: E402  (one causal sequence: q, k, w, windows)
from dsa_plugins.bench.runner import capture_graph, interleaved_graph_ms, ratio_text  # noqa: E402
from dsa_plugins.kernels import indexer as K  # noqa: E402


def equal_work_chunks(plan, n):
    """``n`` chunks (qb0, qb1, width blocks) of about equal score work, from the block ranges (a host read:
    outside the timed region). Work of a query block ~ its key-block count."""
    lo, hi = plan.blk_lo.cpu().tolist(), plan.blk_hi.cpu().tolist()
    work = [max(h - l, 0) for l, h in zip(lo, hi)]
    total = sum(work)
    cuts, acc, target = [0], 0, total / n
    for qb, w in enumerate(work):
        acc += w
        if acc >= target * len(cuts) and len(cuts) < n and qb + 1 < len(work):
            cuts.append(qb + 1)
    cuts.append(len(work))
    chunks = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        width = max(hi[qb] - lo[qb] for qb in range(a, b))
        chunks.append((a, b, width))
    return chunks


def overlapped(plan, chunks, topk, out, side, bufs, reverse=True):
    """Scores of each chunk on the current stream, its top-k on ``side`` once they are written."""
    main = torch.cuda.current_stream()
    order = list(range(len(chunks)))[::-1] if reverse else list(range(len(chunks)))
    for i in order:
        r0, r1, scores = plan.chunk_scores(chunks[i], scores=bufs[i])
        ev = torch.cuda.Event()
        ev.record(main)
        side.wait_event(ev)
        with torch.cuda.stream(side):
            plan.chunk_topk(r0, r1, scores, topk, out)
    main.wait_stream(side)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="8192,32768")
    ap.add_argument("--hi", type=int, default=64)
    ap.add_argument("--chunks", default="2,4,8")
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args(argv)
    hi, di, topk = args.hi, 128, args.topk
    for T in (int(t) for t in args.T.split(",")):
        q, k, w, ks, ke = causal_inputs(T, hi, di)
        ref_out = K.indexer_topk(q, k, w, ks, ke, topk)
        ref_sets = torch.sort(ref_out, 1).values
        plan = K._Plan(q, k, w, ks, ke, None, 1 << 62)
        # the shipped path; past the chunk budget its plan reads the block ranges on the host, so the chunks
        # are planned here, outside the capture, and run as indexer_topk runs them
        shipped = K._Plan(q, k, w, ks, ke, None, K.DEFAULT_MAX_CHUNK_BYTES)
        shipped_out = torch.empty(T, topk, dtype=torch.int32, device="cuda")

        def run_shipped():
            for chunk in shipped.chunks:
                r0, r1, scores = shipped.chunk_scores(chunk)
                shipped.chunk_topk(r0, r1, scores, topk, shipped_out)

        print(f"T{T} shipped: {len(shipped.chunks)} chunk(s)", flush=True)
        programs = {"shipped": run_shipped}
        for n in (int(c) for c in args.chunks.split(",")):
            chunks = equal_work_chunks(plan, n)
            bufs = [torch.empty(min(b * plan.bq, T) - a * plan.bq, wb * plan.bk, dtype=torch.float32, device="cuda")
                    for a, b, wb in chunks]
            out = torch.empty(T, topk, dtype=torch.int32, device="cuda")
            for prio in (0, -1):
                side = torch.cuda.Stream(priority=prio)
                name = f"{n} chunks, side priority {prio}"

                def run(chunks=chunks, out=out, side=side, bufs=bufs):
                    overlapped(plan, chunks, topk, out, side, bufs)
                    return out

                run()
                torch.cuda.synchronize()
                same = (torch.sort(out, 1).values == ref_sets).all().item()
                print(f"T{T} {name}: chunks {[c[:2] for c in chunks]} same sets {same}", flush=True)
                programs[name] = run
            # the same chunks in turn on one stream (what chunking alone costs)
            programs[f"{n} chunks, one stream"] = (
                lambda chunks=chunks, out=out, bufs=bufs: overlapped(plan, chunks, topk, out,
                                                                     torch.cuda.current_stream(), bufs))
        graphs = {name: capture_graph(fn) for name, fn in programs.items()}
        # scores alone and top-k alone (one chunk), for the shares
        buf = torch.empty(T, plan.chunks[0][2] * plan.bk, dtype=torch.float32, device="cuda")
        out1 = torch.empty(T, topk, dtype=torch.int32, device="cuda")
        graphs["scores alone"] = capture_graph(lambda: plan.chunk_scores(plan.chunks[0], scores=buf))
        graphs["top-k alone"] = capture_graph(lambda: plan.chunk_topk(0, T, buf, topk, out1))
        names = list(graphs)
        times = interleaved_graph_ms([graphs[n_] for n_ in names], args.rounds, args.replays)
        for n_, t in zip(names, times):
            print(f"T{T} {n_}: {statistics.median(t):.4f} ms, shipped/this {ratio_text(times[0], t)}", flush=True)
        del graphs, programs, plan, buf, q, k, w
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
