"""Where a generation-step indexer call spends its time: host time per call (no sync), GPU time
(CUDA graph replay), and the kernels it launches (torch.profiler; one call, and 20 graph replays).

    python benchmarks/kernels/indexer_decode_profile.py [B] [context] [index heads] [fp8]   # default 32 32768 64

``fp8`` as a fourth argument: e4m3 queries and keys with per-key scales (the opt-in fp8 index cache's inputs).
"""
import sys
import time

import torch

from dsa_plugins import ops
from dsa_plugins.bench.runner import capture_graph, graph_replay_ms
from dsa_plugins.reference.indexer import quantize_fp8_rows

B, ctx, hi = (int(a) for a in (sys.argv[1:4] + ["32", "32768", "64"][len(sys.argv[1:4]):])[:3])
fp8 = "fp8" in sys.argv[4:]
di, k = 128, 2048
print(f"B {B} context {ctx} index heads {hi}{' fp8' if fp8 else ''}")
g = torch.Generator(device="cuda").manual_seed(0)
# the batched layout the models pass (one query row per sequence, windows of each entry's own keys): the score
# buffer is one cache wide, as in a generation step
q = torch.randn(B, 1, hi, di, device="cuda", generator=g).bfloat16()
kk = torch.randn(B, ctx, di, device="cuda", generator=g).bfloat16()
w = torch.randn(B, 1, hi, device="cuda", generator=g) * (hi * di) ** -0.5
ks = torch.zeros(B, 1, device="cuda", dtype=torch.int32)
ke = ks + ctx
k_scale = None
if fp8:  # per-key scales; the queries' own scales fold into the weights, as the fp8 index cache does
    kk, k_scale = quantize_fp8_rows(kk)
    q, q_scale = quantize_fp8_rows(q)
    w = w * q_scale
fn = lambda: ops.indexer_topk(q, kk, w, k, ks, ke, backend="tilelang", index_k_scale=k_scale)  # noqa: E731
for _ in range(5):
    fn()
torch.cuda.synchronize()
n = 200
t0 = time.perf_counter()
for _ in range(n):
    fn()
t1 = time.perf_counter()
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"host per call {1e3 * (t1 - t0) / n:.3f} ms; wall per call incl. drain {1e3 * (t2 - t0) / n:.3f} ms")
graph = capture_graph(fn, warmup=1)
graph.replay()
torch.cuda.synchronize()
print(f"CUDA graph replay per call {graph_replay_ms(graph, n):.3f} ms (graph-capturable: yes)")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
    fn()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))
kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
step = len(kernels) // 20
print("one replay, kernels in launch order (us):",
      ", ".join(f"{e.name[:24]} {e.device_time:.1f}" for e in kernels[-step:]))
