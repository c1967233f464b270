import torch
from dsa_plugins.bench.runner import median_ms, time_callable
from dsa_plugins import ops
from dsa_plugins.kernels import indexer as K, topk as TK
dev = torch.device("cuda")
t, hi, di, k = 8192, 64, 128, 2048
g = torch.Generator(device="cuda").manual_seed(0)
iq = torch.randn(t, hi, di, device=dev, dtype=torch.bfloat16, generator=g)
ik = torch.randn(t, di, device=dev, dtype=torch.bfloat16, generator=g)
for wname, w in (("rand*scale", torch.rand(t, hi, device=dev, generator=g) * (hi * di) ** -0.5),
                 ("randn", torch.randn(t, hi, device=dev, generator=g))):
    start, end = ops.causal_key_windows(torch.tensor([0, t], device=dev), num_tokens=t)
    f_op = lambda: ops.indexer_topk(iq, ik, w, k, start, end, backend="tilelang")
    f_k = lambda: K.indexer_topk(iq, ik, w, start, end, k)
    flops = 2 * hi * di * t * (t + 1) / 2
    for name, f in (("op", f_op), ("kernel", f_k)):
        a = median_ms(f); b = time_callable(f, dev)[0]
        print(f"{wname:10s} {name:7s} do_bench {a:.3f} ms ({flops/a/1e9:.0f} TF/s)  events {b:.3f} ms ({flops/b/1e9:.0f} TF/s)")
x = torch.randn(64, 32768, device=dev)
for name, f in (("op", lambda: ops.topk_rows(x, None, 2048, backend="tilelang")), ("kernel", lambda: TK.topk_rows(x, None, 2048)), ("torch.topk", lambda: torch.topk(x, 2048))):
    print(f"topk {name:10s} do_bench {median_ms(f):.4f} ms  events {time_callable(f, dev)[0]:.4f} ms")
