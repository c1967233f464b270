"""HF <-> Megatron key mapping and the safetensors converter (CPU, no megatron needed)."""

from __future__ import annotations

import json

import pytest
import torch

from dsa_plugins.adapters.megatron.keymap import KeyMap, detect_family, moe_layers_of
from dsa_plugins.convert import convert, main, parse_size

safetensors = pytest.importorskip("safetensors")


def _mla_keys(layers=3, experts=3, mtp=1, scale_inv=False):
    """HF keys of a DeepSeek-V3.2 / GLM-5 checkpoint: layer 0 dense, others MoE, then MTP layers."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    attn = ["q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
            "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight", "indexer.wq_b.weight",
            "indexer.wk.weight", "indexer.k_norm.weight", "indexer.k_norm.bias", "indexer.weights_proj.weight"]
    for i in range(layers + mtp):
        p = f"model.layers.{i}."
        keys += [p + "self_attn." + a for a in attn]
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if i == 0:
            keys += [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        else:
            keys += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias"]
            keys += [p + f"mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            for e in range(experts):
                keys += [p + f"mlp.experts.{e}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        if i >= layers:
            keys += [p + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                     "shared_head.head.weight", "embed_tokens.weight")]
    if scale_inv:
        keys += [k.replace(".weight", ".weight_scale_inv") for k in keys if k.endswith("proj.weight")]
    return keys


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
    keys = _mla_keys(scale_inv=True)
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
    assert "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight" in to_mg
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
    assert detect_family(keys) == "v4" and detect_family(_mla_keys()) == "mla"
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
    keys = _mla_keys(scale_inv=True)
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
