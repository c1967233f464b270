"""Indexer KL loss timings on one GPU: the fused path (target from the attention backward) against
the standalone loss (target recomputed), at the DeepSeek-V3.2 / GLM-5 training shape.

    python benchmarks/kernels/bench_indexer_loss.py [--out DIR] [--t 8192] [--k 2048] [--h 64]

Writes DIR/indexer_loss.md and DIR/indexer_loss.csv. All figures are triton do_bench medians (L2
flushed), one sequence of T tokens, causal top-k rows (k distinct keys among the prefix, -1 past it).

Rows:
- indexer_fwd: the indexer + top-k op at the same shape (the issue's yardstick: loss <= 2x this);
- attn_bwd / attn_bwd+probs: the sparse attention backward without and with the head-summed P
  output; their difference is what the fused loss adds to the attention backward;
- loss_from_probs: the loss given the target, with and without its gradients (one program), and in
  the deterministic mode (d_index_k stored per slot and summed in a fixed order instead of fp32 atomics);
- fused loss = (attn_bwd+probs - attn_bwd) + loss_from_probs: the loss's cost on the fused path;
- standalone loss fwd+bwd with attn_lse given / None: the recompute path (None is what callers
  without the attention's lse pay: the normaliser needs a second gather);
- step: attention fwd+bwd plus the loss, fused vs standalone (attn_lse None), through the public ops;
  the fused step also inside ``dsa_plugins.deterministic()`` (attention and loss both deterministic).
"""

import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import dsa_plugins  # noqa: E402
from dsa_plugins import ops  # noqa: E402
from dsa_plugins.bench.runner import median_ms  # noqa: E402
from dsa_plugins.kernels import indexer_loss as L  # noqa: E402
from dsa_plugins.kernels.sparse_attention_bwd import sparse_attention_bwd  # noqa: E402
from dsa_plugins.kernels.sparse_attention_fwd import sparse_attention_fwd  # noqa: E402


def causal_topk(t, k, dev):
    r = torch.rand(t, t, device=dev)
    r = r.masked_fill(torch.arange(t, device=dev)[None] > torch.arange(t, device=dev)[:, None], -1.0)
    vals, idx = torch.topk(r, k, dim=1)
    return torch.where(vals >= 0, idx, -1).to(torch.int32)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--t", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--h", type=int, default=64)
    ap.add_argument("--hi", type=int, default=64)
    ap.add_argument("--dqk", type=int, default=576)
    ap.add_argument("--dv", type=int, default=512)
    ap.add_argument("--ablations", action="store_true", help="also time the loss program without its atomics")
    args = ap.parse_args(argv)
    t, k, h, hi, dqk, dv, di = args.t, args.k, args.h, args.hi, args.dqk, args.dv, 128
    dev = "cuda"
    bf = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(t, h, dqk, device=dev, dtype=bf)
    kv = torch.randn(t, dqk, device=dev, dtype=bf)
    iq = torch.randn(t, hi, di, device=dev, dtype=bf)
    ik = torch.randn(t, di, device=dev, dtype=bf)
    w = torch.randn(t, hi, device=dev) * (hi * di) ** -0.5
    idx = causal_topk(t, k, dev)
    scale = dqk ** -0.5
    g = torch.full((t,), 1.0 / t, device=dev)
    name = torch.cuda.get_device_name()
    rows = []

    def add(case, ms, note=""):
        rows.append({"case": case, "ms": round(ms, 4), "note": note})
        print(f"{case:44s} {ms:8.3f} ms  {note}", flush=True)

    # the indexer forward (yardstick)
    ar = torch.arange(t, device=dev, dtype=torch.int32)
    ks, ke = torch.zeros_like(ar), ar + 1
    ms_index = median_ms(lambda: ops.indexer_topk(iq, ik, w, k, ks, ke, backend="tilelang"))
    add("indexer_fwd (indexer + top-k op)", ms_index)
    ms_index_lse = median_ms(lambda: ops.indexer_topk(iq, ik, w, k, ks, ke, backend="tilelang", return_lse=True))
    add("indexer_fwd with return_lse", ms_index_lse, f"+{ms_index_lse - ms_index:.3f} ms for lse(I)")
    # lse(I) over this benchmark's slots (its random causal top-k is not the indexer's selection)
    index_lse = torch.empty(t, device=dev)
    for a in range(0, t, 256):
        keys = ik[idx[a:a + 256].long().clamp_min(0)].float()
        logits = (torch.einsum("rhd,rkd->rhk", iq[a:a + 256].float(), keys).relu() * w[a:a + 256, :, None]).sum(1)
        index_lse[a:a + 256] = torch.logsumexp(logits.masked_fill(idx[a:a + 256] < 0, float("-inf")), -1)

    # attention backward with and without the probs output
    q4, kv3, idx3 = q[None], kv[None], idx[None]
    out, lse = sparse_attention_fwd(q4, kv3, idx3, scale, dv=dv)
    dout = torch.randn_like(out)
    ms_bwd = median_ms(lambda: sparse_attention_bwd(q4, kv3, idx3, out, lse, dout, scale, dv=dv))
    ms_bwd_p = median_ms(lambda: sparse_attention_bwd(q4, kv3, idx3, out, lse, dout, scale, dv=dv, return_probs=True))
    add("attn_bwd", ms_bwd)
    add("attn_bwd+probs", ms_bwd_p, f"+{ms_bwd_p - ms_bwd:.3f} ms")
    probs = sparse_attention_bwd(q4, kv3, idx3, out, lse, dout, scale, dv=dv, return_probs=True)[3][0]

    # the loss given its target: one program (loss rows and gradients), and the value alone
    ms_fp = median_ms(lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g))
    add("loss_from_probs (value and gradients)", ms_fp)
    add("loss_from_probs (value only: pass 1)", median_ms(lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs)))
    ms_det = median_ms(lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=True))
    add("loss_from_probs deterministic (value and gradients)", ms_det, f"{ms_det / ms_fp:.2f}x the atomic mode")
    ms_fpl = median_ms(lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, index_lse=index_lse))
    add("loss_from_probs, index_lse given (no pass 1)", ms_fpl, f"{ms_fp / ms_fpl:.2f}x faster")
    ms_detl = median_ms(lambda: L.indexer_kl_loss_from_probs(iq, ik, w, idx, probs, g, deterministic=True,
                                                             index_lse=index_lse))
    add("loss_from_probs deterministic, index_lse given", ms_detl, f"{ms_det / ms_detl:.2f}x faster")

    # ablation of the program (wrong gradients, timing only): the cost of the d_index_k atomics
    if args.ablations:
        import tilelang

        prog = tilelang.compile(L._loss_program(64, di, True, ablate="no_atomics"), target=L._device_target(q.device),
                                pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: False},
                                compile_flags=["-O3", "-DNDEBUG"])
        idx_p = torch.nn.functional.pad(idx, (0, (-k) % 128), value=-1)
        pr_p = torch.nn.functional.pad(probs, (0, (-k) % 128))
        bufs = (torch.empty(t, idx_p.shape[1], device=dev), torch.empty(1, device=dev), torch.empty(1, device=dev),
                torch.empty(t, device=dev),
                torch.empty(t, 64, di, device=dev, dtype=bf), torch.empty(t, 64, device=dev), torch.zeros(t, di, device=dev))
        add("loss_from_probs ablation: no d_index_k atomics",
            median_ms(lambda: prog(iq, ik, w, idx_p, pr_p, g, *bufs)), "timing only")

    fused = ms_fp + (ms_bwd_p - ms_bwd)
    add("fused loss (probs overhead + loss_from_probs)", fused,
        f"{fused / ms_index:.2f}x indexer_fwd (target <= 2x)")

    # standalone recompute path
    lse2 = lse[0]
    for label, lse_arg in (("attn_lse given", lse2), ("attn_lse None", None)):
        add(f"standalone loss fwd+bwd ({label})",
            median_ms(lambda lse_arg=lse_arg: L.indexer_kl_loss_sparse(iq, ik, w, q, kv, lse_arg, idx, scale, grad_rows=g)))
    add("standalone loss fwd+bwd (attn_lse and index_lse given)",
        median_ms(lambda: L.indexer_kl_loss_sparse(iq, ik, w, q, kv, lse2, idx, scale, grad_rows=g,
                                                   index_lse=index_lse)))

    # one training step of the attention + loss through the public ops
    qg, kvg = q.clone().requires_grad_(), kv.clone().requires_grad_()
    iqg, ikg, wg = iq.clone().requires_grad_(), ik.clone().requires_grad_(), w.clone().requires_grad_()

    def step_fused(lse_arg=None):
        loss = ops.FusedIndexerLoss(iqg, ikg, wg, weight=1.0, index_lse=lse_arg)
        o = ops.sparse_attention(qg, kvg, idx, scale, dv=dv, indexer_loss=loss)
        torch.autograd.grad(o, (qg, kvg, iqg, ikg, wg), dout[0])

    def step_standalone():
        o = ops.sparse_attention(qg, kvg, idx, scale, dv=dv)
        lo = ops.indexer_kl_loss(iqg, ikg, wg, qg, kvg, None, scale, topk_indices=idx)
        torch.autograd.grad((o * dout[0]).sum() + lo, (qg, kvg, iqg, ikg, wg))

    def step_attention():
        o = ops.sparse_attention(qg, kvg, idx, scale, dv=dv)
        torch.autograd.grad(o, (qg, kvg), dout[0])

    ms_att = median_ms(step_attention)
    ms_sf = median_ms(step_fused)
    ms_ss = median_ms(step_standalone)
    add("step: attention fwd+bwd, no loss", ms_att)
    add("step: attention + fused loss", ms_sf, f"loss adds {ms_sf - ms_att:.3f} ms")
    ms_sfl = median_ms(lambda: step_fused(index_lse))
    add("step: attention + fused loss, index_lse given", ms_sfl, f"loss adds {ms_sfl - ms_att:.3f} ms")
    add("step: attention + standalone loss (lse None)", ms_ss, f"loss adds {ms_ss - ms_att:.3f} ms")

    def step_fused_det():
        with dsa_plugins.deterministic():
            step_fused()

    ms_sfd = median_ms(step_fused_det)
    add("step: attention + fused loss, deterministic", ms_sfd, f"{ms_sfd / ms_sf:.2f}x the default step")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "indexer_loss.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=["case", "ms", "note"])
        wr.writeheader()
        wr.writerows(rows)
    with open(os.path.join(args.out, "indexer_loss.md"), "w") as f:
        f.write(f"GPU {name}, torch {torch.__version__}; T {t}, k {k}, H {h}, Dqk {dqk}, Dv {dv}, Hi {hi}, Di {di}, "
                "bf16, causal top-k, triton do_bench medians\n\n| case | ms | note |\n|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['case']} | {r['ms']:.3f} | {r['note']} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
