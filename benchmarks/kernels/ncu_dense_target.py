"""One launch of the dense attention-target program (and, beside it, the slot-list one over the same rows),
for Nsight Compute: ``ncu --nvtx --nvtx-include "target/" python benchmarks/kernels/ncu_dense_target.py``."""
import torch

from dsa_plugins.kernels import indexer_loss as L


def main(t: int = 4096, h: int = 64, d: int = 576) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(t, d, device="cuda", dtype=torch.bfloat16, generator=g)
    lse = torch.full((t, h), 8.0, device="cuda")
    rows = torch.arange(t, device="cuda", dtype=torch.int32)
    win = torch.stack([torch.zeros_like(rows), torch.zeros_like(rows), rows + 1], 1).contiguous()
    slots = torch.arange(t, device="cuda", dtype=torch.int32)[None, :].expand(t, t)
    slots = torch.where(slots <= rows[:, None], slots, -1).contiguous()
    for _ in range(2):
        L._attention_target(q, kv, lse, None, d ** -0.5, win, width=t)
        L._attention_target(q, kv, lse, None, d ** -0.5, slots)
    torch.cuda.synchronize()
    for name, fn in (("dense", lambda: L._attention_target(q, kv, lse, None, d ** -0.5, win, width=t)),
                     ("slots", lambda: L._attention_target(q, kv, lse, None, d ** -0.5, slots))):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(3):
            fn()
        e1.record()
        torch.cuda.synchronize()
        print(f"{name}: {e0.elapsed_time(e1) / 3:.3f} ms", flush=True)
        with torch.cuda.nvtx.range(f"target/{name}"):
            fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
