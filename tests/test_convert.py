"""HF <-> Megatron key mapping and the safetensors converter (CPU, no megatron needed)."""

from __future__ import annotations

import json

import pytest
import torch

from dsa_plugins.adapters.megatron.keymap import KeyMap, Source, detect_family, moe_layers_of
from dsa_plugins.convert import convert, main, parse_size

from .helpers import mla_checkpoint_keys

safetensors = pytest.importorskip("safetensors")


def _v4_keys(layers=2, experts=2):
    keys = ["embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"]
    for i in range(layers):
        p = f"layers.{i}."
        keys += [p + "attn." + n for n in (
            "wq_a.weight", "wq_a.scale", "q_norm.weight", "wq_b.weight", "wkv.weight", "kv_norm.weight",
            "wo_a.weight", "wo_b.weight", "attn_sink", "compressor.wkv.weight", "compressor.wgate.weight",
            "compressor.ape", "compressor.norm.weight", "indexer.wq_b.weight", "indexer.weights_proj.weight",
            "indexer.compressor.wkv.weight", "indexer.compressor.ape")]
        keys += [p + n for n in ("attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                                 "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "ffn.gate.weight", "ffn.gate.bias",
                                 "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                                 "ffn.shared_experts.w3.weight")]
        for e in range(experts):
            keys += [p + f"ffn.experts.{e}.w{j}.{s}" for j in (1, 2, 3) for s in ("weight", "scale")]
    return keys


def _roundtrip(kmap, keys, num_layers=None):
    to_mg = kmap.plan_to_megatron(keys)
    back = kmap.plan_to_hf(to_mg.keys(), num_layers)
    assert sorted(back) == sorted(keys)
    for hf_key, src in back.items():  # each HF key comes back from the megatron key it went into
        fwd = to_mg[src.keys[0]]
        if src.op == "copy":
            assert fwd.op == "copy" and fwd.keys == (hf_key,)
        else:
            assert fwd.op == "cat0" and fwd.keys[int(src.op[-1])] == hf_key
    return to_mg


@pytest.mark.parametrize("layout,experts", [("local", "sequential"), ("te", "grouped"), ("te", "sequential")])
def test_mla_keymap_roundtrip(layout, experts):
    keys = mla_checkpoint_keys(scale_inv=True)
    kmap = KeyMap("mla", num_layers=3, layout=layout, experts=experts, moe_layers=moe_layers_of(keys))
    to_mg = _roundtrip(kmap, keys, 3)
    a = "decoder.layers.1.self_attention."
    assert to_mg[a + "linear_q_down_proj.weight"].keys == ("model.layers.1.self_attn.q_a_proj.weight",)
    assert to_mg[a + "core_attention.indexer.linear_wq_b.weight"].keys == (
        "model.layers.1.self_attn.indexer.wq_b.weight",)
    assert to_mg[a + "linear_kv_up_proj.weight_scale_inv"].keys == ("model.layers.1.self_attn.kv_b_proj.weight_scale_inv",)
    assert to_mg["decoder.layers.0.mlp.linear_fc1.weight"] .keys == (
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert to_mg["decoder.layers.2.mlp.router.expert_bias"].keys == ("model.layers.2.mlp.gate.e_score_correction_bias",)
    assert to_mg["mtp.layers.0.eh_proj.weight"].keys == ("model.layers.3.eh_proj.weight",)
    assert "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight" in to_mg  # megatron-core 0.19
    assert "embedding.word_embeddings.weight" in to_mg and "output_layer.weight" in to_mg
    fc1 = ("mlp.experts.linear_fc1.weight2" if experts == "grouped"
           else "mlp.experts.local_experts.2.linear_fc1.weight")
    assert to_mg["decoder.layers.1." + fc1].op == "cat0"
    if layout == "te":
        assert a + "linear_q_up_proj.layer_norm_weight" in to_mg
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in to_mg  # dense: fused
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in to_mg  # MoE: separate
    else:
        assert a + "q_layernorm.weight" in to_mg and "decoder.layers.0.pre_mlp_layernorm.weight" in to_mg


def test_mtp_names_of_both_megatron_versions():
    """megatron-core 0.19 names an MTP layer's decoder layer ``mtp_model_layer`` in its state dict,
    0.16 ``transformer_layer``: written as asked, both read back."""
    keys = mla_checkpoint_keys()
    for inner in ("mtp_model_layer", "transformer_layer"):
        kmap = KeyMap("mla", num_layers=3, moe_layers=moe_layers_of(keys), mtp_layer=inner)
        to_mg = kmap.plan_to_megatron(keys)
        assert f"mtp.layers.0.{inner}.self_attention.core_attention.indexer.linear_wk.weight" in to_mg
        assert not any(".transformer_layer." in k and inner != "transformer_layer" for k in to_mg)
        assert kmap.mg_to_hf(f"mtp.layers.0.{inner}.mlp.experts.local_experts.1.linear_fc2.weight") == (
            "model.layers.3.mlp.experts.1.down_proj.weight",)
    with pytest.raises(ValueError, match="mtp_layer"):
        KeyMap("mla", num_layers=3, mtp_layer="mtp_layer")


def test_mtp_shared_copies_are_named_and_written_back():
    """An HF MTP layer's embed_tokens / shared_head.head copy the model's embedding / lm_head:
    named so the converter can leave them out of megatron (which shares them), and rebuilt from the
    shared tensors on the way back."""
    keys = mla_checkpoint_keys(mtp=2)
    kmap = KeyMap("mla", num_layers=3, moe_layers=moe_layers_of(keys))
    copies = kmap.mtp_shared_copies(keys)
    assert copies == {
        "model.layers.3.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.3.shared_head.head.weight": "lm_head.weight",
        "model.layers.4.embed_tokens.weight": "model.embed_tokens.weight",
        "model.layers.4.shared_head.head.weight": "lm_head.weight",
    }
    to_mg = kmap.plan_to_megatron([k for k in keys if k not in copies])
    assert not any("embed_tokens" in k or "shared_head.head" in k for k in to_mg)
    back = kmap.plan_to_hf(to_mg, 3)
    assert sorted(back) == sorted(keys)
    assert back["model.layers.4.embed_tokens.weight"] == Source(("embedding.word_embeddings.weight",), "clone")
    assert back["model.layers.3.shared_head.head.weight"].keys == ("output_layer.weight",)
    assert KeyMap("mla", num_layers=None).mtp_shared_copies(keys) == {}


def test_megatron_spellings_all_map_back():
    kmap = KeyMap("mla", num_layers=2)
    for mg, hf in [
        ("decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight", "model.layers.0.self_attn.q_a_layernorm.weight"),
        ("decoder.layers.0.self_attention.kv_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight"),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "model.layers.0.post_attention_layernorm.weight"),
        ("decoder.layers.1.mlp.experts.linear_fc2.weight11", "model.layers.1.mlp.experts.11.down_proj.weight"),
        ("decoder.layers.1.mlp.experts.local_experts.11.linear_fc2.weight", "model.layers.1.mlp.experts.11.down_proj.weight"),
    ]:
        assert kmap.mg_to_hf(mg) == (hf,)


def test_v4_keymap_roundtrip():
    keys = _v4_keys()
    assert detect_family(keys) == "v4" and detect_family(mla_checkpoint_keys()) == "mla"
    kmap = KeyMap("v4", num_layers=2, moe_layers=moe_layers_of(keys))
    to_mg = _roundtrip(kmap, keys, 2)
    a = "decoder.layers.1.self_attention."
    for mg, hf in [
        (a + "linear_q_down_proj.scale", "layers.1.attn.wq_a.scale"),
        (a + "linear_kv_proj.weight", "layers.1.attn.wkv.weight"),
        (a + "linear_o_group_proj.weight", "layers.1.attn.wo_a.weight"),
        (a + "linear_proj.weight", "layers.1.attn.wo_b.weight"),
        (a + "core_attention.attn_sink", "layers.1.attn.attn_sink"),
        (a + "core_attention.compressor.ape", "layers.1.attn.compressor.ape"),
        (a + "core_attention.indexer.compressor.wkv.weight", "layers.1.attn.indexer.compressor.wkv.weight"),
        ("decoder.layers.1.mlp.router.expert_bias", "layers.1.ffn.gate.bias"),
        ("decoder.layers.1.hc_attn_fn", "layers.1.hc_attn_fn"),  # carried unchanged
        ("hc_head_fn", "hc_head_fn"),
    ]:
        assert to_mg[mg].keys == (hf,), mg
    assert to_mg["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.scale"].keys == (
        "layers.0.ffn.experts.1.w1.scale", "layers.0.ffn.experts.1.w3.scale")


def _write_fake(path, keys, seed=0):
    """Random tensors for ``keys`` in two shards + index (norms fp32, others bf16; gate/up pairs
    get equal shapes and dtypes)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in keys:
        dt = torch.float32 if "norm" in k or "bias" in k else torch.bfloat16
        shape = (6, 4) if k.endswith("weight") else (3,)
        tensors[k] = torch.randn(shape, generator=g).to(dt)
    path.mkdir(parents=True)
    half = len(keys) // 2
    shards = {"a.safetensors": keys[:half], "b.safetensors": keys[half:]}
    for name, ks in shards.items():
        save_file({k: tensors[k] for k in ks}, str(path / name))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    (path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "num_hidden_layers": 3}))
    return tensors


def _read_all(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_convert_files_bit_exact(tmp_path):
    keys = mla_checkpoint_keys(scale_inv=True)
    original = _write_fake(tmp_path / "hf", keys)
    assert main(["--to", "megatron", str(tmp_path / "hf"), str(tmp_path / "mg"), "--max-shard-size", "2KB",
                 "--no-progress"]) == 0
    mg = _read_all(tmp_path / "mg")
    index = json.loads((tmp_path / "mg" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(mg) and len(set(index["weight_map"].values())) > 1  # sharded
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([original["model.layers.0.mlp.gate_proj.weight"],
                                       original["model.layers.0.mlp.up_proj.weight"]]))
    assert (tmp_path / "mg" / "config.json").exists()
    assert main(["--to", "hf", str(tmp_path / "mg"), str(tmp_path / "hf2"), "--no-progress"]) == 0
    back = _read_all(tmp_path / "hf2")
    assert back.keys() == original.keys()
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
    assert not (tmp_path / "hf2" / "dsa_plugins_convert.json").exists()


def test_convert_leaves_out_identical_mtp_copies_and_writes_them_back(tmp_path, capsys):
    """GLM-5 / V3.2 checkpoints store the MTP layer's embed_tokens / shared_head.head as copies of
    the model's: megatron (0.19 names) gets neither, the way back rebuilds them bit-exactly; a copy
    that differs is carried with a warning. 0.16 names on request."""
    from safetensors.torch import save_file

    keys = mla_checkpoint_keys()
    original = _write_fake(tmp_path / "hf", keys)
    # make embed_tokens of the MTP layer a true copy (shared_head.head stays different)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.3.embed_tokens.weight"]
    from safetensors.torch import load_file

    part = load_file(str(tmp_path / "hf" / shard))
    part["model.layers.3.embed_tokens.weight"] = original["model.embed_tokens.weight"].clone()
    original["model.layers.3.embed_tokens.weight"] = part["model.layers.3.embed_tokens.weight"]
    save_file(part, str(tmp_path / "hf" / shard))
    convert(str(tmp_path / "hf"), str(tmp_path / "mg"), "megatron", progress=False)
    assert "shared_head.head.weight differs from lm_head.weight" in capsys.readouterr().out
    mg = _read_all(tmp_path / "mg")
    assert "mtp.layers.0.embed_tokens.weight" not in mg and "mtp.layers.0.shared_head.head.weight" in mg
    assert "mtp.layers.0.mtp_model_layer.self_attention.linear_q_down_proj.weight" in mg
    meta = json.loads((tmp_path / "mg" / "dsa_plugins_convert.json").read_text())
    assert meta["mtp_copies_left_out"] == ["model.layers.3.embed_tokens.weight"] and meta["megatron"] == "0.19"
    convert(str(tmp_path / "mg"), str(tmp_path / "back"), "hf", progress=False)
    back = _read_all(tmp_path / "back")
    assert back.keys() == original.keys()
    for k, t in original.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
    assert main(["--to", "megatron", str(tmp_path / "hf"), str(tmp_path / "mg16"), "--megatron", "0.16",
                 "--no-progress"]) == 0
    assert "mtp.layers.0.transformer_layer.self_attention.linear_q_down_proj.weight" in _read_all(tmp_path / "mg16")


def test_round_trip_adds_no_mtp_copy_the_checkpoint_did_not_have(tmp_path):
    """MTP layers without embed_tokens / shared_head.head copies come back without them (the
    conversion's record says which copies it left out); a megatron dir from elsewhere (no record)
    gets both rebuilt for each MTP layer."""
    keys = [k for k in mla_checkpoint_keys() if not k.endswith(("layers.3.embed_tokens.weight",
                                                                "layers.3.shared_head.head.weight"))]
    original = _write_fake(tmp_path / "hf", keys)
    convert(str(tmp_path / "hf"), str(tmp_path / "mg"), "megatron", progress=False)
    convert(str(tmp_path / "mg"), str(tmp_path / "back"), "hf", progress=False)
    assert _read_all(tmp_path / "back").keys() == original.keys()
    (tmp_path / "mg" / "dsa_plugins_convert.json").unlink()
    convert(str(tmp_path / "mg"), str(tmp_path / "rebuilt"), "hf", num_layers=3, progress=False)
    rebuilt = _read_all(tmp_path / "rebuilt")
    assert set(rebuilt) - set(original) == {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert torch.equal(rebuilt["model.layers.3.shared_head.head.weight"], original["lm_head.weight"])


def test_convert_dequantizes_block_scaled_fp8_on_request(tmp_path, capsys):
    """DeepSeek-V3.2's release stores e4m3 weights with 128 x 128 block scales: kept as they are by
    default (with a note), written as bf16 with --dequantize-fp8 (gate/up halves each with its own
    scales), the scales left out."""
    from safetensors.torch import save_file

    from dsa_plugins.convert import fp8_block_dequant

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(200, 300, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.5
    want = w.float().clone()
    for i in range(2):
        for j in range(3):
            want[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= s[i, j]
    assert torch.equal(fp8_block_dequant(w, s), want.bfloat16())
    with pytest.raises(ValueError, match="does not tile"):
        fp8_block_dequant(w, s[:1])

    keys = mla_checkpoint_keys(layers=2, experts=1, mtp=0)
    tensors = {}
    for k in keys:
        tensors[k] = torch.randn(256, 256, generator=g).bfloat16() if k.endswith("weight") else torch.randn(3)
        if k.endswith(("proj.weight",)) and "indexer" not in k:
            tensors[k] = tensors[k].float().to(torch.float8_e4m3fn)
            tensors[k[: -len("weight")] + "weight_scale_inv"] = torch.rand(2, 2, generator=g) + 0.5
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v32", "num_hidden_layers": 2,
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}))
    convert(str(tmp_path / "hf"), str(tmp_path / "kept"), "megatron", progress=False)
    assert "--dequantize-fp8" in capsys.readouterr().out
    kept = _read_all(tmp_path / "kept")
    assert kept["decoder.layers.1.self_attention.linear_q_down_proj.weight"].dtype == torch.float8_e4m3fn
    assert "decoder.layers.1.self_attention.linear_q_down_proj.weight_scale_inv" in kept
    assert main(["--to", "megatron", str(tmp_path / "hf"), str(tmp_path / "bf16"), "--dequantize-fp8",
                 "--no-progress"]) == 0
    mg = _read_all(tmp_path / "bf16")
    assert not any(k.endswith("scale_inv") for k in mg)
    assert all(t.dtype != torch.float8_e4m3fn for t in mg.values())
    q = "model.layers.1.self_attn.q_a_proj."
    assert torch.equal(mg["decoder.layers.1.self_attention.linear_q_down_proj.weight"],
                       fp8_block_dequant(tensors[q + "weight"], tensors[q + "weight_scale_inv"]))
    e = "model.layers.1.mlp.experts.0."
    assert torch.equal(mg["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"], torch.cat([
        fp8_block_dequant(tensors[e + "gate_proj.weight"], tensors[e + "gate_proj.weight_scale_inv"]),
        fp8_block_dequant(tensors[e + "up_proj.weight"], tensors[e + "up_proj.weight_scale_inv"])]))
    assert torch.equal(mg["decoder.layers.0.input_layernorm.weight"], tensors["model.layers.0.input_layernorm.weight"])
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())  # no longer announces fp8
    assert "quantization_config" not in cfg and cfg["model_type"] == "deepseek_v32"
    meta = json.loads((tmp_path / "bf16" / "dsa_plugins_convert.json").read_text())
    assert meta["quantization_config_removed"]["weight_block_size"] == [128, 128]
    assert "quantization_config" in json.loads((tmp_path / "kept" / "config.json").read_text())


def test_convert_single_file_v4_and_cli(tmp_path):
    from safetensors.torch import save_file

    keys = _v4_keys()
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(4, 2, generator=g).to(torch.float8_e4m3fn if ".scale" in k else torch.bfloat16)
               for k in keys}
    (tmp_path / "v4").mkdir()
    save_file(tensors, str(tmp_path / "v4" / "model.safetensors"))
    convert(str(tmp_path / "v4"), str(tmp_path / "mg"), "megatron", progress=False)
    meta = json.loads((tmp_path / "mg" / "dsa_plugins_convert.json").read_text())
    assert meta["family"] == "v4"
    cli = pytest.importorskip("dsa_plugins.cli")
    assert cli.main(["convert", "--to", "hf", str(tmp_path / "mg"), str(tmp_path / "back"), "--no-progress"]) == 0
    back = _read_all(tmp_path / "back")
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k


def test_convert_errors(tmp_path):
    assert parse_size("2KB") == 2000 and parse_size("1GiB") == 2**30
    with pytest.raises(ValueError):
        KeyMap("mla").plan_to_megatron(["model.layers.0.mlp.gate_proj.weight"])  # up missing
    with pytest.raises(ValueError):
        convert(str(tmp_path), str(tmp_path), "megatron")
