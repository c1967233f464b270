"""Run the tiny megatron-0.19 DSA model at a context-parallel size on CPU (gloo) and save what it
computed, in global token order.

    python mcore019_worker.py CP OUT_FILE [BACKEND] [cuda SEQLEN]

``cuda``: one GPU per rank (NCCL), bf16, GLM-5 attention dims, one layer, ``SEQLEN`` tokens in all,
and the median time of a training step (the CP benchmark); otherwise CPU processes with gloo, fp32,
tiny dims (the test).

Each of the CP processes holds the zigzag shard megatron's data loader gives it (chunks r and
2 * CP - 1 - r of the sequence); the objective is the sum of the per-token LM losses (additive over
ranks) and the indexer loss scale is 1 / CP (each rank averages over its own rows), so the
gradients summed over the ranks are the CP = 1 gradients. Rank 0 saves the per-token losses, the
selected keys of every layer (global key positions), the summed gradients and the logged
indexer losses.
"""

from __future__ import annotations

import os
import socket
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _zigzag(cp: int, rank: int, s: int) -> torch.Tensor:
    chunk = s // (2 * cp)
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                      torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])


def run(rank: int, cp: int, port: int, out: str, backend: str, seqlen: int = 0) -> None:
    sys.path.insert(0, HERE)
    import mcore019 as M
    import torch.distributed as dist

    cuda = seqlen > 0
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        M.apply_cpu_shims()
    M.init_distributed(rank=rank, world=cp, cp=cp, port=port, dist_backend="nccl" if cuda else "gloo")
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    import dsa_plugins.adapters.megatron as adapter
    from dsa_plugins.adapters.megatron import backend as B

    adapter.register()
    selected = []
    real_select = B._select

    def spy_select(*a, **k):
        r = real_select(*a, **k)
        selected.append(r[0] if isinstance(r, tuple) else r)  # (rows, lse) where the sparse loss takes the lse
        return r

    B._select = spy_select

    if cuda:
        _, model = M.build(backend=backend, cp=cp, loss_coeff=0.1, sparse_loss=True, dims=M.GLM5_ATTENTION,
                           topk=2048, num_layers=1, dtype=torch.bfloat16, device="cuda")
        tokens, labels = M.batch(b=1, s=seqlen, seed=5, device="cuda")
    else:
        _, model = M.build(backend=backend, cp=cp, loss_coeff=0.1, sparse_loss=True)
        tokens, labels = M.batch(b=2, s=16, seed=5)
    rows = _zigzag(cp, rank, tokens.shape[1]).to(device)
    position_ids = rows.unsqueeze(0).expand(tokens.shape[0], -1)
    M.reset_tracker()
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0 / cp, device=device))
    model.train()

    def train_step():
        out = model(tokens[:, rows], position_ids, attention_mask=None, labels=labels[:, rows])
        out.float().sum().backward()
        return out

    per_token = train_step()
    step_ms = None
    if cuda:  # the median of a few more steps (the selections recorded above are from the first one)
        times = []
        for _ in range(5):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            train_step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        step_ms = sorted(times)[len(times) // 2]
        selected = selected[:1]  # one layer, the first step

    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
    gathered_loss = [torch.zeros_like(per_token) for _ in range(cp)]
    dist.all_gather(gathered_loss, per_token.detach().contiguous())
    picks = torch.stack([s.long().sort(-1).values for s in selected])  # [layers, b, s_local, k]
    gathered_picks = [torch.zeros_like(picks) for _ in range(cp)]
    dist.all_gather(gathered_picks, picks)
    tracker = M.tracker_values()
    dist.all_reduce(tracker)
    if rank == 0:
        order = torch.cat([_zigzag(cp, r, tokens.shape[1]) for r in range(cp)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        losses = torch.cat(gathered_loss, dim=1)[:, inverse]
        picks = torch.cat(gathered_picks, dim=2)[:, :, inverse]
        to_cpu = lambda t: t.detach().cpu()  # noqa: E731
        torch.save({"losses": to_cpu(losses), "picks": to_cpu(picks), "grads": {n: to_cpu(g) for n, g in grads.items()},
                    "tracker": to_cpu(tracker / cp), "step_ms": step_ms,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    cp, out = int(argv[1]), argv[2]
    backend = argv[3] if len(argv) > 3 else "dsa_plugins"
    seqlen = int(argv[5]) if len(argv) > 5 and argv[4] == "cuda" else 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(run, args=(cp, port, out, backend, seqlen), nprocs=cp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
