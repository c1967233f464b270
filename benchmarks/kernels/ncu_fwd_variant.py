"""One launch of the forward for Nsight Compute, with compile-time overrides.

    ncu --kernel-name regex:main --launch-skip 1 --launch-count 1 --section SourceCounters \
        --page source --print-source sass --csv python benchmarks/kernels/ncu_fwd_variant.py mla_h64 '{"schedule": "seesaw"}'

Shapes: the peers benchmark's 8K shapes (mla_h128, mla_h64, v4_h128, v4_h64); ``NAME@SKV`` (e.g. mla_h128@131072)
takes the same shape over a cache of SKV keys. Calls the forward twice on the
same inputs (the first compiles and warms up): skip one launch to profile the second. ``flashmla`` in place of
the overrides runs FlashMLA's sparse prefill instead (staged peer; its kernel name matches regex:sparse_attn_fwd).
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))

from bench_attention_peers import SHAPES_8K, make_inputs  # noqa: E402

NAMES = ("mla_h128", "mla_h64", "v4_h128", "v4_h64")


def main() -> None:
    import torch

    from dsa_plugins.kernels.sparse_attention_fwd import _check_inputs, _launch

    name, arg = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}"
    name, _, long_skv = name.partition("@")
    _op, s, skv, h, dqk, dv, k, sink = SHAPES_8K[NAMES.index(name)]
    skv = int(long_skv) if long_skv else skv
    q, kv, idx, z = make_inputs(s, skv, h, dqk, dv, k, sink)
    if arg == "flashmla":
        from bench_attention_peers import flashmla_forward
        from common import import_peer

        flash_mla = import_peer("flash_mla", "flashmla")
        for _ in range(2):
            flashmla_forward(flash_mla, q, kv, idx, dqk**-0.5, dv, z)
        torch.cuda.synchronize()
        return
    overrides = json.loads(arg)
    scale, dv = _check_inputs(q, kv, idx, dqk**-0.5, z, dv)
    out = torch.empty(*q.shape[:3], dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for _ in range(2):
        _launch(q, kv, idx, scale, z, dv, out, lse, overrides=overrides)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
