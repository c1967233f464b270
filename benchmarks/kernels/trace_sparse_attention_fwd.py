"""Where a forward CTA's time goes: a timeline per CTA from SM clock stamps (an experiment, not shipped).

    python benchmarks/kernels/trace_sparse_attention_fwd.py [--shapes v4k|8k] [--ablate no_q,no_store]
                                                            [--overrides JSON] [--out DIR]

A copy of ``dsa_plugins/kernels/sparse_attention_fwd.py`` is patched as text (``traced_source``) so that
one thread of each role writes ``clock64`` at fixed points into an extra int64 tensor Trace [CTAs, 16] (either
schedule: qk_one's consumers or the seesaw's):

    0 SM id   1 CTA start   2 producer done   3 Q staged (consumers)   4 / 12 first stage ready
    (consumer 0 / 1)   5 / 13 main loop done   6 both consumers at the final barrier   7 / 15 consumer
    0 / 1 done (output issued)   9 / 10 global timer at 1 / 7 (clock rate)

Per CTA it prints the medians of: start -> Q staged, start -> first stage ready, the main loop per 64-slot
block, final barrier -> end (the epilogue), and the gap between one CTA's end and the next CTA's start on
the same SM. ``--ablate`` patches the copy further for timing only (wrong numbers): ``no_q`` stages Q as
zeros without loading it, ``no_store`` keeps the output in shared memory (thread-copy program only). The
copy is compiled as its own module; the shipped program is untouched, and the traced one is checked
bitwise against it (without ablations). A CPU test keeps the patches applying (``tests/test_forward_tools.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from source_patch import import_patched, replace_exact  # noqa: E402
SOURCE = ROOT / "dsa_plugins" / "kernels" / "sparse_attention_fwd.py"

_PRELUDE = r'''
_TRACE_PRELUDE = _FWD_PRELUDE + r"""
__device__ __forceinline__ void dsa_trace(int64_t* p) {
  long long c; asm volatile("mov.u64 %0, %%clock64;" : "=l"(c) :: "memory"); *p = c; }
__device__ __forceinline__ void dsa_trace_sm(int64_t* p) {
  unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); *p = s; }
__device__ __forceinline__ void dsa_trace_gt(int64_t* p) {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) :: "memory"); *p = (int64_t)t; }
"""
'''


def _stamp(slot, fn="dsa_trace", slot_expr=None):
    return f'T.call_extern("handle", "{fn}", T.address_of(Trace[cta, {slot_expr or slot}]))'


_replace = replace_exact


def traced_source(ablate: tuple[str, ...] = ()) -> str:
    """The forward module's source with the clock stamps (and the ablations) patched in."""
    s = SOURCE.read_text()
    s = _replace(s, "_TORCH_DTYPES = {", _PRELUDE + "\n_TORCH_DTYPES = {")
    dyn = 'B, S, H, SKV, KP = T.dynamic("batch, seqlen, heads, seqlen_kv, topk_padded")'
    s = _replace(s, dyn, dyn + '\n    TRN = T.dynamic("trace_rows")')
    row_trips = '        RowTrips: T.Tensor([B, SO] if skip_tail else [1], "int32"),  # trips of 2 * BK slots per row\n'
    s = _replace(s, row_trips, row_trips + '        Trace: T.Tensor([TRN, 16], "int64"),\n')
    s = _replace(s, "([_FWD_PRELUDE] if hint else [])", "[_TRACE_PRELUDE]")
    head = "            tx = T.get_thread_binding()\n            h0 = bx * HB\n"
    s = _replace(s, head, head + "            cta = (bz * SO + by) * T.ceildiv(H, HB) + bx\n"
                 f"            if tx == 0:\n                {_stamp(0, 'dsa_trace_sm')}\n                {_stamp(1)}\n"
                 f"                {_stamp(9, 'dsa_trace_gt')}\n")
    for name in ("rows_consumer0", "rows_consumer1"):
        s = _replace(s, f"{name}(c, ", f"{name}(Trace, cta, c, ", count=3)
    wait = "                T.barrier_wait(bar_ready[st][0], (base + t) & 1)\n                T.fence_proxy_async()\n"
    first = _stamp(None, slot_expr="4 + 8 * (T.get_thread_binding() // 128)")
    s = _replace(s, wait, "                T.barrier_wait(bar_ready[st][0], (base + t) & 1)\n"
                 "                if st == 0:\n                    if t == 0:\n"
                 f"                        if T.get_thread_binding() % 128 == 0:\n                            {first}\n"
                 "                T.fence_proxy_async()\n", count=2)
    sums = '        # row sums of both halves ("split") or of consumer 0 alone\n'
    s = _replace(s, sums, f"        if T.get_thread_binding() == 0:\n            {_stamp(5)}\n" + sums)
    fin0 = "        T.sync_threads(_BAR_FIN, 256)\n        for h in T.Parallel(HB):\n            rs0[h]"
    s = _replace(s, fin0, "        T.sync_threads(_BAR_FIN, 256)\n"
                 f"        if T.get_thread_binding() == 0:\n            {_stamp(6)}\n"
                 "        for h in T.Parallel(HB):\n            rs0[h]")
    end0 = "        finish(0, c, rs0, m_i0, alpha0, acc_o0, Q_l, Sinks, Output, Lse, bz, by, h0, stages=stages, cl=cl)\n"
    s = _replace(s, end0, end0 + f"        if T.get_thread_binding() == 0:\n            {_stamp(7)}\n"
                 f"            {_stamp(10, 'dsa_trace_gt')}\n")
    sums1 = "        if split:\n            for h in T.Parallel(HB):\n                l_s[1, h] = l_i1[h]\n"
    s = _replace(s, sums1, f"        if T.get_thread_binding() == 128:\n            {_stamp(13)}\n" + sums1)
    end1 = "        finish(1, c, rs1, m_i1, alpha1, acc_o1, Q_r, Sinks, Output, Lse, bz, by, h0, stages=stages, cl=cl)\n"
    s = _replace(s, end1, end1 + f"        if T.get_thread_binding() == 128:\n            {_stamp(15)}\n")
    prod = ("                    producer(Indices, KV, bz, by, n_trips, idx_reg, stages, valid, bar_ready, bar_free, "
            "tx - 256, 0)\n")
    s = _replace(s, prod, prod + f"                    if tx == 256:\n                        {_stamp(2)}\n")
    staged = ("                else:\n                    stage_q(Q, bz, qrow, h0, Q_l, Q_r, Q_t)\n")
    s = _replace(s, staged, staged + f"                if tx == 0:\n                    {_stamp(3)}\n")
    # the seesaw consumers (the prefill default): the same slots (4: consumer 0's first half-stage landed)
    ind = "                    "
    first = ind + "    seesaw_scores(Q_l, Q_r, Q_t, stages[0], bar_ready, 0, 0, acc_s0)\n"
    issue = ind + "    seesaw_issue(Q_l, Q_r, Q_t, stages[0], bar_ready, 0, 0, acc_s0, {})\n"
    s = _replace(s, first, issue.format(0) + f"{ind}    if tx == 0:\n{ind}        {_stamp(4)}\n" + issue.format(1)
                 + f"{ind}    T.wait_wgmma(0)\n")
    for g, (loop_done, fin, end) in enumerate(((5, 6, 7), (13, 14, 15))):
        tid = 128 * g
        sums = f"{ind}for h in T.Parallel(HB):\n{ind}    l_s[{g}, h] = l_i{g}[h]\n{ind}T.sync_threads(_BAR_FIN, 256)\n"
        s = _replace(s, sums, f"{ind}if tx == {tid}:\n{ind}    {_stamp(loop_done)}\n" + sums
                     + f"{ind}if tx == {tid}:\n{ind}    {_stamp(fin)}\n")
        fin_call = (f"{ind}finish({g}, c, rs{g}, m_i{g}, alpha{g}, acc_o{g}, {'Q_l' if g == 0 else 'Q_r'}, Sinks, "
                    f"Output, Lse, bz, by, h0, m_scaled=True,\n{ind}       stages=stages, cl=cl)\n")
        extra = f"{ind}    {_stamp(10, 'dsa_trace_gt')}\n" if g == 0 else ""
        s = _replace(s, fin_call, fin_call + f"{ind}if tx == {tid}:\n{ind}    {_stamp(end)}\n" + extra)
    s = _replace(s, "seesaw_odd(c, ", "seesaw_odd(Trace, cta, c, ", count=2)
    wg1_first = "        seesaw_mask_max(valid[1], acc_s, m_blk)\n"
    s = _replace(s, wg1_first, wg1_first + "        if t == 0:\n            if T.get_thread_binding() == 128:\n"
                 f"                {_stamp(12)}\n")
    sprod = ("                    seesaw_producer(Indices, KV, bz, by, n_trips, idx_reg, idx_reg1, stages, valid, "
             "bar_ready,\n                                    bar_free, tx - 256)\n")
    s = _replace(s, sprod, sprod + f"                    if tx == 256:\n                        {_stamp(2)}\n")
    if "no_q" in ablate:
        s = _replace(s, "T.if_then_else(h0 + hh < H, Q[", "T.if_then_else(h0 + hh < -1, Q[", count=3)
        s = _replace(s, "stage_q_tma(Q, bz, qrow, h0, Q_l, Q_r, Q_t, bar_q)\n",
                     "stage_q(Q, bz, qrow, h0, Q_l, Q_r, Q_t)\n")
    if "no_store" in ablate:
        s = _replace(s, "if h0 + h < H:\n                        Output[bz, by, h0 + h, g * D_half + d] = O_s[h, d]",
                     "if h0 + h < -1:\n                        Output[bz, by, h0 + h, g * D_half + d] = O_s[h, d]")
    return s


def traced_module(ablate: tuple[str, ...] = ()):
    """Import the patched copy as a module of its own (TileLang reads the source from the file)."""
    return import_patched(traced_source(ablate), f"traced_fwd_{'_'.join(ablate) or 'plain'}")


def summarise(trace, k: int) -> dict:
    """Medians in us over the CTAs of one launch (clock64 per SM; the global timer gives its rate)."""
    import numpy as np

    c = trace.numpy().astype(np.float64)
    ns_per_cycle = float(np.median((c[:, 10] - c[:, 9]) / np.maximum(1, c[:, 7] - c[:, 1])))
    end = np.maximum.reduce([c[:, 2], c[:, 7], c[:, 15]])
    gaps = []
    sm = c[:, 0].astype(int)
    for s in np.unique(sm):
        order = np.argsort(c[sm == s, 1])
        starts, ends = c[sm == s, 1][order], end[sm == s][order]
        gaps += list(starts[1:] - ends[:-1])

    def us(x):
        return float(np.median(x)) * ns_per_cycle / 1e3

    blocks = -(-k // 64)
    return {"cta_us": us(end - c[:, 1]), "q_staged_us": us(c[:, 3] - c[:, 1]), "first_ready_us": us(c[:, 4] - c[:, 1]),
            "loop_per_block_us": us(c[:, 5] - c[:, 4]) / blocks, "epilogue_us": us(c[:, 7] - c[:, 6]),
            "gap_us": us(np.array(gaps)), "ns_per_cycle": ns_per_cycle}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="v4k", choices=["v4k", "8k"])
    ap.add_argument("--ablate", default="", help="comma list of no_q, no_store (timing only)")
    ap.add_argument("--overrides", default="{}", help='compile-time overrides, e.g. {"tma_io": false}')
    ap.add_argument("--out", default=None, help="folder for the raw traces (.pt)")
    args = ap.parse_args(argv)
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))
    from bench_attention_peers import SHAPES_8K, SHAPES_K, make_inputs

    from dsa_plugins.common.indices import row_blocks
    from dsa_plugins.kernels.sparse_attention_fwd import device_target, sparse_attention_fwd

    ablate = tuple(a for a in args.ablate.split(",") if a)
    mod = traced_module(ablate)
    overrides = json.loads(args.overrides)
    for _op, s, skv, h, dqk, dv, k, sink in SHAPES_K if args.shapes == "v4k" else SHAPES_8K:
        q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
        cfg = mod.config_for(dqk, dv, sink, q.dtype, overrides)
        kernel = mod.build_fwd_kernel(cfg, target=device_target(0))
        kp = -(-k // 128) * 128
        idx_p = torch.nn.functional.pad(idx, (0, kp - k), value=-1).contiguous()
        trips = row_blocks(idx_p.view(s, kp), 128, skv).view(1, s)
        sinks = z if z is not None else torch.zeros(h, device="cuda")
        out = torch.empty(1, s, h, dv, device="cuda", dtype=q.dtype)
        lse = torch.empty(1, s, h, device="cuda")
        trace = torch.zeros(s * -(-h // 64), 16, dtype=torch.int64, device="cuda")
        for _ in range(3):
            kernel(q, kv, idx_p, sinks, dqk**-0.5, out, lse, trips, trace)
        torch.cuda.synchronize()
        same = "-"  # ablations change the numbers; overrides compile another program than the op's
        if not ablate and not overrides:
            same = str(torch.equal(out, sparse_attention_fwd(q, kv, idx, dqk**-0.5, z, dv)[0]))
        row = summarise(trace.cpu(), k)
        print(f"H{h} D{dqk}/{dv} k{k}: same bits as the shipped op {same}; per CTA (median us) "
              + ", ".join(f"{key[:-3]} {val:.2f}" for key, val in row.items() if key.endswith("_us")), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            torch.save({"trace": trace.cpu(), "k": k, "h": h, "dqk": dqk, **row},
                       Path(args.out) / f"trace_h{h}_d{dqk}_k{k}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
