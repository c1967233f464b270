"""Our checkpoint key map against Megatron-Bridge's (the HF <-> Megatron converter users run):
for every Megatron tensor our plan writes from a GLM-5 / DeepSeek-V3.2 checkpoint (which share their
HF names), the bridge's own lookup names the same HF tensors, with gate/up concatenated in the same
order. Runs where megatron-bridge imports (it needs Transformer Engine); skipped elsewhere.

Megatron-Bridge 0.6.2 maps GLM-5 (``GLM5Bridge``); it has no DeepSeek-V3.2 bridge, and its
DeepSeek-V3 one has no indexer, so the V3.2 keys are checked against the GLM-5 mappings.

Names only (the bridge's lookup works without a model), so a parameter the bridge maps and our
plan never writes is not seen here. On 2026-11-24 the bridge's own conversion of tiny GLM-5 and
V3.2 checkpoints into a CPU-built GPTModel loaded 71 of 71 tensors bit-identical to our plan.
"""

from __future__ import annotations

import types

import pytest

from dsa_plugins.adapters.megatron.keymap import KeyMap, moe_layers_of

from tests.helpers import mla_checkpoint_keys

glm5_bridge = pytest.importorskip("megatron.bridge.models.glm_moe_dsa.glm5_bridge", exc_type=ImportError)


@pytest.mark.parametrize("layout,experts", [("local", "sequential"), ("local", "grouped"), ("te", "sequential"),
                                            ("te", "grouped")])
def test_every_megatron_tensor_comes_from_the_same_hf_tensors(layout, experts):
    layers, mtp = 3, 1
    bridge = glm5_bridge.GLM5Bridge()
    # the registry reads only these two fields of the HF config
    bridge.hf_config = types.SimpleNamespace(num_hidden_layers=layers, num_nextn_predict_layers=mtp)
    registry = bridge.mapping_registry()
    keys = mla_checkpoint_keys(layers=layers, experts=3, mtp=mtp)
    kmap = KeyMap("mla", num_layers=layers, layout=layout, experts=experts, moe_layers=moe_layers_of(keys))
    copies = kmap.mtp_shared_copies(keys)  # megatron's MTP shares them: the converter leaves copies out
    assert set(copies) == {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    plan = kmap.plan_to_megatron([k for k in keys if k not in copies])
    disagree = []
    for name, source in sorted(plan.items()):
        mapping = registry.megatron_to_hf_lookup(name)
        if mapping is None:
            disagree.append((name, source.keys, None))
            continue
        hf = mapping.hf_param
        theirs = (hf,) if isinstance(hf, str) else (hf["gate"], hf["up"]) if "gate" in hf else tuple(hf.values())
        if theirs != source.keys or (source.op == "cat0") != (type(mapping).__name__ == "GatedMLPMapping"):
            disagree.append((name, source.keys, theirs))
    assert not disagree, disagree
