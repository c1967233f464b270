"""Demo: zero-code-change DSA in Hugging Face Transformers.

``python -m dsa_plugins demo`` (or ``python -m dsa_plugins.demo``):

1. builds a tiny GLM-5 (``glm_moe_dsa``) and a tiny DeepSeek-V4 from configs with random weights and
   saves them with ``save_pretrained`` (safetensors) to a temporary directory;
2. starts a fresh Python process whose code never imports dsa_plugins: it loads each model with
   ``attn_implementation="dsa_tilelang"`` (valid only because ``import torch`` ran the
   ``torch.backends`` entry point of dsa_plugins) and with ``"eager"``, runs a prefill and a greedy
   generation (batch 2, left padding) with both, and compares logits and tokens;
3. prints a table (model, backend, max logit difference, tokens equal, time) and exits non-zero on a
   mismatch.

On a machine without a GPU it runs the torch reference of the ops in fp32; on a CUDA GPU the
TileLang kernels in bf16 (with sizes the kernels support).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

# The child never imports dsa_plugins: everything below goes through transformers only.
_CHILD = textwrap.dedent(
    r"""
    import json, sys, time
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(sys.argv[1])
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    rows = []
    for name, path in spec["models"]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, spec["vocab"], (2, spec["prompt"]), generator=g).to(device)
        mask = torch.ones_like(ids)
        mask[1, : spec["pad"]] = 0
        result, times = {}, {}
        for impl in ("eager", "dsa_tilelang"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl).to(device).eval()
            assert model.config._attn_implementation == impl
            with torch.no_grad():
                try:
                    model(ids, attention_mask=mask)  # warm-up (first-call costs, kernel compilation)
                except Exception as exc:
                    if impl != "eager":
                        raise
                    # the baseline itself: some transformers releases cannot run a model in this dtype
                    import transformers
                    rows.append(dict(model=name, skipped=f"transformers {transformers.__version__}'s own eager "
                                     f"{spec['dtype']} forward fails: {type(exc).__name__}: {str(exc)[:120]}"))
                    break
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                prefill = model(ids, attention_mask=mask).logits.float()
                out = model.generate(
                    ids, attention_mask=mask, max_new_tokens=spec["new_tokens"], do_sample=False, pad_token_id=2,
                    output_logits=True, return_dict_in_generate=True,
                )
                if device == "cuda":
                    torch.cuda.synchronize()
                times[impl] = time.perf_counter() - t0
            steps = torch.stack([x.float() for x in out.logits])
            result[impl] = (prefill, steps, out.sequences)
        if len(result) < 2:
            continue
        valid = mask.bool()
        (p0, s0, q0), (p1, s1, q1) = result["eager"], result["dsa_tilelang"]
        new0, new1 = q0[:, ids.shape[1]:], q1[:, ids.shape[1]:]
        differ = (new0 != new1).any(0).nonzero()
        last = int(differ[0]) if len(differ) else s0.shape[0] - 1  # compare logits up to the first divergence
        diff = max((p0 - p1)[valid].abs().max().item(), (s0[: last + 1] - s1[: last + 1]).abs().max().item())
        scale = max(p0[valid].abs().max().item(), s0.abs().max().item())
        gap = 0.0  # at the first divergence: how far below eager's choice the plugin's token scores
        if len(differ):
            b = int((new0[:, last] != new1[:, last]).nonzero()[0])
            logits = s0[last, b]
            gap = (logits[new0[b, last]] - logits[new1[b, last]]).item()
        rows.append(dict(
            model=name, max_logit_diff=diff, logit_scale=scale, tokens_equal=bool(torch.equal(q0, q1)),
            divergence_gap=gap, finite=bool(torch.isfinite(p1).all() and torch.isfinite(s1).all()),
            time_dsa=times["dsa_tilelang"], time_eager=times["eager"],
        ))
    autoloaded = "dsa_plugins._autoload" in sys.modules
    print("DEMO_RESULT " + json.dumps(dict(rows=rows, autoloaded=autoloaded)))
    """
)


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.value == "dsa_plugins._autoload:autoload" for ep in eps)


def _configs(gpu: bool) -> dict:
    """model name -> (model_type, config overrides). On a GPU: head sizes the kernels support."""
    if not gpu:
        return {
            "GLM-5 (glm_moe_dsa)": ("glm_moe_dsa", {}),
            "DeepSeek-V4 (deepseek_v4)": ("deepseek_v4", {}),
        }
    return {
        "GLM-5 (glm_moe_dsa)": (
            "glm_moe_dsa",
            dict(
                hidden_size=256, num_attention_heads=64, num_key_value_heads=64, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=128,
                index_n_heads=32, index_head_dim=128, index_topk=64,
            ),
        ),
        "DeepSeek-V4 (deepseek_v4)": (
            "deepseek_v4",
            dict(
                hidden_size=256, num_attention_heads=64, head_dim=512, q_lora_rank=128, o_lora_rank=64,
                partial_rotary_factor=0.125,
                index_n_heads=64, index_head_dim=128, index_topk=16, sliding_window=64,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
            ),
        ),
    }


def _backend_label(gpu: bool) -> str:
    backend = os.environ.get("DSA_PLUGINS_BACKEND", "auto").strip().lower() or "auto"
    if not gpu or backend == "torch":
        return f"torch reference ({'bf16 cuda' if gpu else 'fp32 cpu'})"
    try:
        from dsa_plugins.ops import is_dsa_kernel_available

        kernels = is_dsa_kernel_available("sparse_attention")
    except Exception:
        kernels = False
    if not kernels:
        return "torch reference (bf16 cuda; kernels unavailable)"
    return "tilelang kernels (bf16 cuda)" if backend == "tilelang" else "tilelang kernels where supported (bf16 cuda)"


def _table(rows: list[dict], backend: str) -> str:
    head = ("model", "backend", "max |logit diff|", "tokens equal", "time dsa / eager")
    lines = [head]
    for r in rows:
        if "skipped" in r:
            lines.append((r["model"], backend, "-", "not compared", "-"))
            continue
        lines.append((
            r["model"], backend, f"{r['max_logit_diff']:.2e}",
            "yes" if r["tokens_equal"] else f"no (gap {r['divergence_gap']:.1e} at the first divergence)",
            f"{r['time_dsa']:.2f} s / {r['time_eager']:.2f} s",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(lines[0]), sep] + [fmt(line) for line in lines[1:]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsa_plugins demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--keep", metavar="DIR", help="save the models here instead of a temporary directory")
    args = parser.parse_args(argv)

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"dsa_plugins demo needs torch and transformers: {exc}", file=sys.stderr)
        return 2
    if not _entry_point_installed():
        print(
            "dsa_plugins demo: the torch.backends entry point of dsa_plugins is not installed, so a process that "
            "does not import dsa_plugins cannot see it. Install the package: pip install -e . (or pip install "
            "dsa-plugins).",
            file=sys.stderr,
        )
        return 2
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if gpu and not torch.cuda.is_available():
        print("dsa_plugins demo: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2

    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="dsa_plugins_demo_")
    try:
        return _run(args, gpu, args.keep or tmp.name)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _run(args, gpu: bool, workdir: str) -> int:
    from dsa_plugins.adapters.hf.tiny import tiny_model

    models = []
    t0 = time.perf_counter()
    for name, (model_type, overrides) in _configs(gpu).items():
        path = os.path.join(workdir, model_type)
        tiny_model(model_type, seed=0, **overrides).save_pretrained(path, safe_serialization=True)
        models.append((name, path))
    print(f"saved {len(models)} random-weight models to {workdir} ({time.perf_counter() - t0:.1f} s)")

    spec = dict(
        models=models, device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
        vocab=100, prompt=16 if not gpu else 96, pad=5, new_tokens=args.new_tokens,
    )
    env = dict(os.environ)
    env.pop("DSA_PLUGINS_AUTOLOAD", None)  # the point of the demo is the autoload
    print("loading them with attn_implementation='dsa_tilelang' in a fresh process that does not import dsa_plugins")
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=1800
    )
    result = next((line for line in proc.stdout.splitlines() if line.startswith("DEMO_RESULT ")), None)
    if proc.returncode != 0 or result is None:
        print(proc.stdout[-4000:], proc.stderr[-6000:], sep="\n", file=sys.stderr)
        print("dsa_plugins demo: the child process failed", file=sys.stderr)
        return 1
    data = json.loads(result[len("DEMO_RESULT "):])
    rows = data["rows"]
    print(_table(rows, _backend_label(gpu)))

    ok, skipped = _verdict(data, gpu)
    if not ok:
        print("demo FAILED")
    elif skipped:
        # the installed transformers cannot run that model's own eager path here: nothing to compare with
        print(f"all models match eager where transformers' eager path runs; not compared: {'; '.join(skipped)}")
    else:
        print("all models match eager")
    return 0 if ok else 1


def _verdict(data: dict, gpu: bool) -> tuple[bool, list[str]]:
    """(every compared model matches eager and the plugin was autoloaded, the models not compared and why).
    A model whose eager baseline fails inside transformers is not compared (said on stdout), not a failure."""
    rel_tol = 5e-2 if gpu else 1e-5
    ok = data["autoloaded"]
    if not ok:
        print("MISMATCH: dsa_plugins was not loaded through the torch.backends entry point", file=sys.stderr)
    skipped = []
    for r in data["rows"]:
        if "skipped" in r:
            skipped.append(f"{r['model']} ({r['skipped']})")
            continue
        tol = rel_tol * max(r["logit_scale"], 1.0)
        # bf16 on a GPU: a greedy step may flip between two tokens whose logits tie within rounding
        tokens_ok = r["tokens_equal"] or (gpu and r["divergence_gap"] <= tol)
        good = r["finite"] and tokens_ok and r["max_logit_diff"] <= tol
        if not good:
            print(f"MISMATCH: {r['model']}: {r}", file=sys.stderr)
        ok = ok and good
    if len(skipped) == len(data["rows"]):
        print("MISMATCH: no model could be compared", file=sys.stderr)
        ok = False
    return ok, skipped


if __name__ == "__main__":
    sys.exit(main())
