"""Run the tiny megatron-0.19 DSA model at a context-parallel size on CPU (gloo) and save what it
computed, in global token order.

    python mcore019_worker.py CP OUT_FILE [BACKEND]

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


def run(rank: int, cp: int, port: int, out: str, backend: str) -> None:
    sys.path.insert(0, HERE)
    import mcore019 as M
    import torch.distributed as dist

    M.apply_cpu_shims()
    M.init_distributed(rank=rank, world=cp, cp=cp, port=port)
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    import dsa_plugins.adapters.megatron as adapter
    from dsa_plugins.adapters.megatron import backend as B

    adapter.register()
    selected = []
    real_select = B._select
    B._select = lambda *a, **k: selected.append(r := real_select(*a, **k)) or r

    _, model = M.build(backend=backend, cp=cp, loss_coeff=0.1, sparse_loss=True)
    tokens, labels = M.batch(b=2, s=16, seed=5)
    rows = _zigzag(cp, rank, tokens.shape[1])
    position_ids = rows.unsqueeze(0).expand(tokens.shape[0], -1)
    M.reset_tracker()
    DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0 / cp))
    model.train()
    per_token = model(tokens[:, rows], position_ids, attention_mask=None, labels=labels[:, rows])
    per_token.float().sum().backward()

    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
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
        torch.save({"losses": losses, "picks": picks, "grads": grads, "tracker": tracker / cp}, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    cp, out = int(argv[1]), argv[2]
    backend = argv[3] if len(argv) > 3 else "dsa_plugins"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(run, args=(cp, port, out, backend), nprocs=cp, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
