"""Fine-tuning under dsa_tilelang (``examples/hf_finetune.py``, accelerate) and the opt-in indexer loss.

CPU fp32: the tiny models' loss curve over 50 steps is eager's; with ``enable_indexer_loss`` the
indexers get gradients (and only they get new ones), and their KL to the attention ends lower than
when it is only measured. GPU bf16: the same through the TileLang kernels (fused loss program).
"""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import dsa_plugins.hf
from dsa_plugins.adapters.hf import tiny

ROOT = Path(__file__).resolve().parents[3]


def _example():
    spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "examples" / "hf_finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hf_finetune", module)
    spec.loader.exec_module(module)
    return module


def _require(model_type):
    if not tiny.available(model_type):
        pytest.skip(f"{model_type} is not in transformers {__import__('transformers').__version__}")


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v4"])
def test_finetune_loss_curve_matches_eager(registered, model_type):
    """50 AdamW steps of the tiny model (fp32, CPU): every step's loss within 1% of eager attention's."""
    _require(model_type)
    run = _example().main
    ours = run(["--model", f"tiny:{model_type}", "--steps", "50", "--log-every", "1000"])
    ref = run(["--model", f"tiny:{model_type}", "--steps", "50", "--attn", "eager", "--log-every", "1000"])
    assert len(ours) == len(ref) == 50
    for a, b in zip(ours, ref):
        assert abs(a["loss"] - b["loss"]) <= 0.01 * abs(b["loss"]), (a, b)
    assert ours[-1]["loss"] < 0.8 * ours[0]["loss"]  # the run learns something (the curve is not flat)


def test_indexer_loss_lowers_the_indexers_kl(registered):
    """With the loss trained (weight 1) the indexers' KL to the attention ends well below the KL of the
    same run where it is only measured (weight ~0: Adam's step on a 1e-12 gradient is nil)."""
    run = _example().main
    trained = run(["--steps", "50", "--indexer-loss", "1.0", "--log-every", "1000"])
    measured = run(["--steps", "50", "--indexer-loss", "1e-12", "--log-every", "1000"])
    assert all("indexer_kl" in r and r["indexer_kl"] >= 0 for r in trained + measured)
    assert trained[0]["indexer_kl"] == pytest.approx(measured[0]["indexer_kl"], rel=1e-6)  # same first step
    assert trained[-1]["indexer_kl"] < 0.6 * measured[-1]["indexer_kl"]


def test_indexer_loss_trains_only_the_indexer(registered, make_batch):
    """One backward with the loss on: the indexers' parameters get gradients, every other parameter
    gets exactly the gradient it gets with the loss off; one value per indexed layer is recorded."""
    grads = {}
    for on in (False, True):
        model = tiny.tiny_model("glm_moe_dsa")
        model.set_attn_implementation("dsa_tilelang")
        model.train()
        handle = dsa_plugins.hf.enable_indexer_loss(model, weight=0.5) if on else None
        ids, mask = make_batch(seed=5)
        model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
        grads[on] = {n: p.grad for n, p in model.named_parameters()}
        if on:
            assert handle.layers == 2 and len(handle.values) == 2  # GLM-5's "shared" layer has no indexer
            assert all(torch.isfinite(v) and v >= 0 for v in handle.values)
    for name, g in grads[True].items():
        if ".indexer." in name:
            assert grads[False][name] is None and g is not None and g.abs().sum() > 0, name
        else:
            assert (g is None) == (grads[False][name] is None), name
            if g is not None:
                assert torch.equal(g, grads[False][name]), name


def test_indexer_loss_only_where_it_can_serve(registered, make_batch):
    """Refused with a message on eager and on models without a V3.2-family indexer; inert in eval mode,
    under no_grad and once removed."""
    model = tiny.tiny_model("glm_moe_dsa")
    with pytest.raises(ValueError, match="attn_implementation"):
        dsa_plugins.hf.enable_indexer_loss(model)
    if tiny.available("deepseek_v4"):
        v4 = tiny.tiny_model("deepseek_v4", attn_implementation="dsa_tilelang")
        with pytest.raises(ValueError, match="no indexer this loss serves"):
            dsa_plugins.hf.enable_indexer_loss(v4)
    model.set_attn_implementation("dsa_tilelang")
    handle = dsa_plugins.hf.enable_indexer_loss(model)
    ids, mask = make_batch(seed=6)
    model.eval()
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    model.train()
    with torch.no_grad():
        model(ids, attention_mask=mask, labels=ids, use_cache=False)
    assert handle.values == []
    handle.remove()
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    assert handle.values == []
    assert all(p.grad is None for n, p in model.named_parameters() if ".indexer." in n)


def test_lora_finetune_trains_adapters_and_indexers(registered):
    """LoRA through peft on the attention projections, indexer loss on: finite losses, and the loss falls."""
    pytest.importorskip("peft")
    example = _example()
    log = example.main(["--steps", "30", "--lora", "8", "--indexer-loss", "0.1", "--lr", "3e-3",
                        "--log-every", "1000"])
    lora = example.apply_lora(tiny.tiny_model("glm_moe_dsa"), 4)
    names = [n for n, _ in lora.named_parameters()]
    assert any("lora_A" in n and ".self_attn." in n for n in names)
    assert not any("lora_" in n and ".indexer." in n for n in names)  # the indexers train whole, not as LoRA
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log)
    assert log[-1]["loss"] < log[0]["loss"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_indexer_loss_through_the_kernels(registered, make_batch, monkeypatch):
    """GLM-5 head sizes in bf16 with the kernels forced: the fused loss program runs in the attention
    backward, the indexers get finite gradients, and training them lowers the KL against measuring it."""
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    kls = {}
    for weight in (1.0, 1e-12):
        torch.manual_seed(0)
        model = tiny.tiny_model("glm_moe_dsa", **tiny.kernel_sizes("glm_moe_dsa")).to("cuda", torch.bfloat16)
        model.set_attn_implementation("dsa_tilelang")
        model.train()
        handle = dsa_plugins.hf.enable_indexer_loss(model, weight=weight)
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if ".indexer." in n], lr=1e-3)
        ids, mask = make_batch(seq_len=512, pad=40)
        ids, mask = ids.cuda(), mask.cuda()
        curve = []
        for _ in range(20):
            model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
            assert all(torch.isfinite(p.grad).all() for n, p in model.named_parameters()
                       if ".indexer." in n and p.grad is not None)
            curve.append(float(handle.mean()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        kls[weight] = curve
    assert kls[1.0][0] == pytest.approx(kls[1e-12][0], rel=1e-3)
    assert kls[1.0][-1] < 0.8 * kls[1e-12][-1], kls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_autocast_mixed_precision_runs_the_kernels(registered, make_batch, monkeypatch):
    """fp32 weights under torch.autocast bf16 (what accelerate's and the Trainer's bf16 mixed precision do):
    with the kernels forced (an fp32 input would raise), the attention, indexer and fused loss run in bf16; the
    loss is eager attention's under the same autocast, the fp32 parameters get finite gradients."""
    monkeypatch.setenv("DSA_PLUGINS_BACKEND", "tilelang")
    ids, mask = make_batch(seq_len=512, pad=40)
    ids, mask = ids.cuda(), mask.cuda()
    losses = {}
    for attn in ("dsa_tilelang", "eager"):
        torch.manual_seed(0)
        model = tiny.tiny_model("glm_moe_dsa", **tiny.kernel_sizes("glm_moe_dsa")).to("cuda")
        model.set_attn_implementation(attn)
        model.train()
        handle = dsa_plugins.hf.enable_indexer_loss(model, weight=0.1) if attn == "dsa_tilelang" else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, attention_mask=mask, labels=ids, use_cache=False).loss
        loss.backward()
        losses[attn] = float(loss)
        assert all(p.grad is None or (p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all())
                   for p in model.parameters())
        if handle is not None:
            assert len(handle.values) == 2 and all(torch.isfinite(v) for v in handle.values)
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
                       if ".indexer." in n)
    assert losses["dsa_tilelang"] == pytest.approx(losses["eager"], rel=2e-2), losses


def test_indexer_loss_with_transformers_default_cache(registered, make_batch):
    """A plain training forward (use_cache left to the config: transformers makes an empty cache) still
    trains the indexers (a wrapper that skipped every call with a cache left the loss silently off)."""
    model = tiny.tiny_model("glm_moe_dsa")
    model.set_attn_implementation("dsa_tilelang")
    model.train()
    handle = dsa_plugins.hf.enable_indexer_loss(model)
    ids, mask = make_batch(seed=7)
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    assert len(handle.values) == 2
    assert all(p.grad is not None for n, p in model.named_parameters() if ".indexer.wk." in n)
