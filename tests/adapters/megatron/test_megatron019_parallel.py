"""Context parallel 2 against 1 through megatron 0.19's own DSA with dsa_plugins as its backend (two
gloo CPU processes): per-token losses, the selected keys of every layer (the canonical top-k makes
them exact), the gradients summed over the ranks and the logged indexer loss."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

WORKER = os.path.join(os.path.dirname(__file__), "mcore019_worker.py")


def test_cp2_matches_cp1(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU workers on a GPU machine too (megatron puts RoPE on a visible GPU)
    procs = {cp: subprocess.Popen([sys.executable, WORKER, str(cp), str(tmp_path / f"cp{cp}.pt")], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cp in (1, 2)}
    for cp, proc in procs.items():
        out, _ = proc.communicate(timeout=280)
        assert proc.returncode == 0, f"CP {cp} worker failed:\n{out[-3000:]}"
    one, two = (torch.load(tmp_path / f"cp{cp}.pt") for cp in (1, 2))
    assert torch.equal(two["picks"], one["picks"])  # the same keys for every query row of every layer
    torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(two["tracker"], one["tracker"], rtol=1e-5, atol=1e-8)
    assert one["grads"].keys() == two["grads"].keys()
    for name, g in one["grads"].items():
        # fp32 sums in another order (the ranks' halves, then gloo's all-reduce): ~1e-7 absolute on
        # entries of ~1e-3 (seen 3.7e-7 on the embedding); a wrong gradient is off by its own size
        torch.testing.assert_close(two["grads"][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
