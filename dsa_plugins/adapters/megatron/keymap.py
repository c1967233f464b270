"""Checkpoint key mapping between Hugging Face and Megatron-core for DSA models.

Families (``family``):

- ``"mla"``: DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``), HF hub layout
  (``model.layers.N.self_attn.q_a_proj.weight``, per-expert ``mlp.experts.E.gate_proj.weight``).
- ``"v4"``: DeepSeek-V4 in its released layout (``layers.N.attn.wq_a.weight``, ``ffn.experts.E.w1``).

Megatron names follow ``GPTModel`` (``decoder.layers.N.self_attention.linear_q_down_proj.weight``).
``layout="local"`` uses separate norms (``q_layernorm``, ``kv_layernorm``, ``pre_mlp_layernorm``:
dsa_plugins' DSA spec and megatron's local spec); ``layout="te"`` uses Transformer Engine's fused
names (``linear_q_up_proj.layer_norm_weight``, dense ``mlp.linear_fc1.layer_norm_weight``).
``experts="sequential"`` gives ``mlp.experts.local_experts.E.linear_fc1.weight``; ``"grouped"``
gives TEGroupedMLP's ``mlp.experts.linear_fc1.weightE``. Megatron -> HF accepts every variant.

Every mapping is a rename except MLP ``linear_fc1`` = cat(gate, up) on dim 0 (split back in
halves), so a round trip is bit-exact. Parameters are matched by module path, so quantisation
siblings (``weight_scale_inv``, ``scale``) follow their weight. Keys no rule knows are carried
under the other side's layer prefix unchanged (DeepSeek-V4 hyper-connection ``hc_*`` tensors, for
example), which keeps round trips exact. Layers at index >= ``num_layers`` (DeepSeek MTP) map to
``mtp.layers.i``: ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm`` and the inner decoder layer
under ``mtp_layer`` (``"mtp_model_layer"`` in megatron-core 0.19's state dict, ``"transformer_layer"``
in 0.16's; both are read back). An HF MTP layer's ``embed_tokens`` / ``shared_head.head`` are copies
of the model's embedding and output layer, which megatron's MTP shares:
:meth:`KeyMap.mtp_shared_copies` names them so the converter can leave identical copies out, and
:meth:`KeyMap.plan_to_hf` writes them back from the shared tensors (HF-format MTP loaders read them).
Megatron-Bridge 0.6.2's GLM-5 mappings agree with these names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

FAMILIES = ("mla", "v4")
LAYOUTS = ("local", "te")
EXPERT_LAYOUTS = ("sequential", "grouped")
#: Name of an MTP layer's inner decoder layer: megatron-core 0.19 (``mtp_model_layer``), 0.16.
MTP_LAYER_NAMES = ("mtp_model_layer", "transformer_layer")

_P = r"(?P<P>[A-Za-z_]+)"  # parameter name (weight, bias, weight_scale_inv, scale); no digits: see weightE
_E = r"(?P<E>\d+)"


@dataclass(frozen=True)
class Rule:
    """``hf``: one pattern, or two whose tensors are concatenated on dim 0 into ``mg``.
    Patterns use ``{P}`` (parameter name) and ``{E}`` (expert index); ``mg_alt`` are other
    Megatron spellings accepted on the way back."""

    hf: tuple[str, ...]
    mg: str
    mg_alt: tuple[str, ...] = ()


def _mla_rules(layout: str, experts: str, moe_layer: bool) -> list[Rule]:
    te = layout == "te"
    q_norm, kv_norm = "self_attention.q_layernorm.{P}", "self_attention.kv_layernorm.{P}"
    q_norm_te, kv_norm_te = (
        "self_attention.linear_q_up_proj.layer_norm_{P}",
        "self_attention.linear_kv_up_proj.layer_norm_{P}",
    )
    mlp_norm, mlp_norm_te = "pre_mlp_layernorm.{P}", "mlp.linear_fc1.layer_norm_{P}"
    fc1, fc2 = _expert_names(experts)
    ix = "self_attention.core_attention.indexer."
    return [
        Rule(("self_attn.q_a_proj.{P}",), "self_attention.linear_q_down_proj.{P}"),
        Rule(("self_attn.q_a_layernorm.{P}",), q_norm_te if te else q_norm, (q_norm, q_norm_te)),
        Rule(("self_attn.q_b_proj.{P}",), "self_attention.linear_q_up_proj.{P}"),
        Rule(("self_attn.q_proj.{P}",), "self_attention.linear_q_proj.{P}"),
        Rule(("self_attn.kv_a_proj_with_mqa.{P}",), "self_attention.linear_kv_down_proj.{P}"),
        Rule(("self_attn.kv_a_layernorm.{P}",), kv_norm_te if te else kv_norm, (kv_norm, kv_norm_te)),
        Rule(("self_attn.kv_b_proj.{P}",), "self_attention.linear_kv_up_proj.{P}"),
        Rule(("self_attn.o_proj.{P}",), "self_attention.linear_proj.{P}"),
        Rule(("self_attn.indexer.wq_b.{P}",), ix + "linear_wq_b.{P}"),
        Rule(("self_attn.indexer.wk.{P}",), ix + "linear_wk.{P}"),
        Rule(("self_attn.indexer.k_norm.{P}",), ix + "k_norm.{P}"),
        Rule(("self_attn.indexer.weights_proj.{P}",), ix + "linear_weights_proj.{P}"),
        Rule(("input_layernorm.{P}",), "input_layernorm.{P}"),
        Rule(
            ("post_attention_layernorm.{P}",),
            mlp_norm_te if (te and not moe_layer) else mlp_norm,
            (mlp_norm, mlp_norm_te),
        ),
        Rule(("mlp.gate_proj.{P}", "mlp.up_proj.{P}"), "mlp.linear_fc1.{P}"),
        Rule(("mlp.down_proj.{P}",), "mlp.linear_fc2.{P}"),
        Rule(("mlp.gate.weight",), "mlp.router.weight"),
        Rule(("mlp.gate.e_score_correction_bias",), "mlp.router.expert_bias"),
        Rule(("mlp.experts.{E}.gate_proj.{P}", "mlp.experts.{E}.up_proj.{P}"), fc1, _expert_alts("fc1")),
        Rule(("mlp.experts.{E}.down_proj.{P}",), fc2, _expert_alts("fc2")),
        Rule(
            ("mlp.shared_experts.gate_proj.{P}", "mlp.shared_experts.up_proj.{P}"),
            "mlp.shared_experts.linear_fc1.{P}",
        ),
        Rule(("mlp.shared_experts.down_proj.{P}",), "mlp.shared_experts.linear_fc2.{P}"),
    ]


def _v4_rules(layout: str, experts: str, moe_layer: bool) -> list[Rule]:
    fc1, fc2 = _expert_names(experts)
    sa = "self_attention."
    return [
        Rule(("attn.wq_a.{P}",), sa + "linear_q_down_proj.{P}"),
        Rule(("attn.q_norm.{P}",), sa + "q_layernorm.{P}", (sa + "linear_q_up_proj.layer_norm_{P}",)),
        Rule(("attn.wq_b.{P}",), sa + "linear_q_up_proj.{P}"),
        Rule(("attn.wkv.{P}",), sa + "linear_kv_proj.{P}"),
        Rule(("attn.kv_norm.{P}",), sa + "kv_layernorm.{P}"),
        Rule(("attn.wo_a.{P}",), sa + "linear_o_group_proj.{P}"),
        Rule(("attn.wo_b.{P}",), sa + "linear_proj.{P}"),
        Rule(("attn.attn_sink",), sa + "core_attention.attn_sink"),
        Rule(("attn.compressor.{R}",), sa + "core_attention.compressor.{R}"),
        Rule(("attn.indexer.{R}",), sa + "core_attention.indexer.{R}"),
        Rule(("attn_norm.{P}",), "input_layernorm.{P}"),
        Rule(("ffn_norm.{P}",), "pre_mlp_layernorm.{P}", ("mlp.linear_fc1.layer_norm_{P}",)),
        Rule(("ffn.gate.weight",), "mlp.router.weight"),
        Rule(("ffn.gate.bias",), "mlp.router.expert_bias"),
        Rule(("ffn.gate.{R}",), "mlp.router.{R}"),
        Rule(("ffn.experts.{E}.w1.{P}", "ffn.experts.{E}.w3.{P}"), fc1, _expert_alts("fc1")),
        Rule(("ffn.experts.{E}.w2.{P}",), fc2, _expert_alts("fc2")),
        Rule(("ffn.shared_experts.w1.{P}", "ffn.shared_experts.w3.{P}"), "mlp.shared_experts.linear_fc1.{P}"),
        Rule(("ffn.shared_experts.w2.{P}",), "mlp.shared_experts.linear_fc2.{P}"),
    ]


def _expert_names(experts: str) -> tuple[str, str]:
    if experts == "grouped":
        return "mlp.experts.linear_fc1.{P}{E}", "mlp.experts.linear_fc2.{P}{E}"
    return "mlp.experts.local_experts.{E}.linear_fc1.{P}", "mlp.experts.local_experts.{E}.linear_fc2.{P}"


def _expert_alts(which: str) -> tuple[str, ...]:
    return (f"mlp.experts.linear_{which}.{{P}}{{E}}", f"mlp.experts.local_experts.{{E}}.linear_{which}.{{P}}")


_TOP = {
    "mla": [("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
            ("model.norm.weight", "decoder.final_layernorm.weight"),
            ("lm_head.weight", "output_layer.weight")],
    "v4": [("embed.weight", "embedding.word_embeddings.weight"),
           ("norm.weight", "decoder.final_layernorm.weight"),
           ("head.weight", "output_layer.weight")],
}
_LAYER_PREFIX = {"mla": "model.layers.", "v4": "layers."}
_MTP_PLAIN = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "shared_head.norm": "final_layernorm"}
# HF MTP layer tensors that copy a shared one: layer-relative name -> the model's own (HF, Megatron)
_MTP_SHARED = {"embed_tokens.weight": ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
               "shared_head.head.weight": ("lm_head.weight", "output_layer.weight")}


def _compile(pattern: str) -> re.Pattern:
    out, i = "", 0
    for m in re.finditer(r"\{([PER])\}", pattern):
        out += re.escape(pattern[i : m.start()])
        out += {"P": _P, "E": _E, "R": r"(?P<R>.+)"}[m.group(1)]
        i = m.end()
    return re.compile(out + re.escape(pattern[i:]) + r"\Z")


def _fill(template: str, groups: dict) -> str:
    return re.sub(r"\{([PER])\}", lambda m: groups[m.group(1)], template)


@dataclass(frozen=True)
class Source:
    """One output tensor: the input keys it is made of and how (``"copy"``, ``"clone"``: a copy in
    its own memory, for a second output of one input, ``"cat0"`` of two, ``"half0"`` / ``"half1"``:
    first / second half of one tensor on dim 0)."""

    keys: tuple[str, ...]
    op: str


class KeyMap:
    """HF <-> Megatron names for one model (see the module docstring)."""

    def __init__(
        self,
        family: str = "mla",
        num_layers: Optional[int] = None,
        layout: str = "local",
        experts: str = "sequential",
        moe_layers: Optional[Iterable[int]] = None,
        mtp_layer: str = "mtp_model_layer",
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if experts not in EXPERT_LAYOUTS:
            raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
        if mtp_layer not in MTP_LAYER_NAMES:
            raise ValueError(f"mtp_layer must be one of {MTP_LAYER_NAMES}, got {mtp_layer!r}")
        self.mtp_layer = mtp_layer
        self.family, self.num_layers, self.layout, self.experts = family, num_layers, layout, experts
        self.moe_layers = None if moe_layers is None else set(moe_layers)
        make = _mla_rules if family == "mla" else _v4_rules
        self._rules = {moe: make(layout, experts, moe) for moe in (False, True)}
        self._compiled = {
            moe: [([_compile(p) for p in r.hf], [_compile(p) for p in (r.mg, *r.mg_alt)], r) for r in rules]
            for moe, rules in self._rules.items()
        }
        self._top = dict(_TOP[family])
        self._top_rev = {v: k for k, v in self._top.items()}
        self._hf_layer = re.compile(re.escape(_LAYER_PREFIX[family]) + r"(?P<L>\d+)\.(?P<rest>.+)\Z")
        self._mg_layer = re.compile(r"decoder\.layers\.(?P<L>\d+)\.(?P<rest>.+)\Z")
        self._mg_mtp = re.compile(r"mtp\.layers\.(?P<L>\d+)\.(?P<rest>.+)\Z")

    # ----------------------------------------------------------------- layer-relative names
    def _is_moe(self, layer: int) -> bool:
        return self.moe_layers is not None and layer in self.moe_layers

    def layer_hf_to_mg(self, rest: str, layer: int) -> tuple[str, int]:
        """Layer-relative HF name -> (Megatron name, slot): slot 0/1 = gate/up part of a cat,
        -1 = whole tensor. Unknown names are returned unchanged."""
        for hf_pats, mg_pats, rule in self._compiled[self._is_moe(layer)]:
            for slot, pat in enumerate(hf_pats):
                m = pat.match(rest)
                if m:
                    return _fill(rule.mg, m.groupdict()), (slot if len(hf_pats) == 2 else -1)
        return rest, -1

    def layer_mg_to_hf(self, rest: str, layer: int) -> tuple[str, ...]:
        """Layer-relative Megatron name -> HF names (two for a gate/up cat)."""
        for hf_pats, mg_pats, rule in self._compiled[self._is_moe(layer)]:
            for pat in mg_pats:
                m = pat.match(rest)
                if m:
                    return tuple(_fill(p, m.groupdict()) for p in rule.hf)
        return (rest,)

    # ----------------------------------------------------------------- whole-model names
    def hf_to_mg(self, key: str) -> tuple[str, int]:
        if key in self._top:
            return self._top[key], -1
        m = self._hf_layer.match(key)
        if not m:
            return key, -1
        layer, rest = int(m.group("L")), m.group("rest")
        if self.num_layers is not None and layer >= self.num_layers:  # MTP
            i = layer - self.num_layers
            for hf_mod, mg_mod in _MTP_PLAIN.items():
                if rest.startswith(hf_mod + "."):
                    return f"mtp.layers.{i}.{mg_mod}{rest[len(hf_mod):]}", -1
            if rest.startswith(("embed_tokens.", "shared_head.")):
                return f"mtp.layers.{i}.{rest}", -1
            name, slot = self.layer_hf_to_mg(rest, layer)
            return f"mtp.layers.{i}.{self.mtp_layer}.{name}", slot
        name, slot = self.layer_hf_to_mg(rest, layer)
        return f"decoder.layers.{layer}.{name}", slot

    def mg_to_hf(self, key: str, num_layers: Optional[int] = None) -> tuple[str, ...]:
        if key in self._top_rev:
            return (self._top_rev[key],)
        prefix = _LAYER_PREFIX[self.family]
        m = self._mg_layer.match(key)
        if m:
            layer = int(m.group("L"))
            return tuple(f"{prefix}{layer}.{n}" for n in self.layer_mg_to_hf(m.group("rest"), layer))
        m = self._mg_mtp.match(key)
        if m:
            n_layers = self.num_layers if num_layers is None else num_layers
            if n_layers is None:
                raise ValueError(f"{key}: mapping MTP layers back needs num_layers")
            layer, rest = n_layers + int(m.group("L")), m.group("rest")
            for hf_mod, mg_mod in _MTP_PLAIN.items():
                if rest.startswith(mg_mod + "."):
                    return (f"{prefix}{layer}.{hf_mod}{rest[len(mg_mod):]}",)
            for inner in MTP_LAYER_NAMES:
                if rest.startswith(inner + "."):
                    names = self.layer_mg_to_hf(rest[len(inner) + 1 :], layer)
                    return tuple(f"{prefix}{layer}.{n}" for n in names)
            return (f"{prefix}{layer}.{rest}",)
        return (key,)

    # ----------------------------------------------------------------- plans
    def plan_to_megatron(self, hf_keys: Iterable[str]) -> dict[str, Source]:
        """Megatron key -> how to build it from the HF keys."""
        parts: dict[str, dict[int, str]] = {}
        for key in hf_keys:
            name, slot = self.hf_to_mg(key)
            slots = parts.setdefault(name, {})
            if slot in slots or (slot == -1 and slots) or (slot != -1 and -1 in slots):
                raise ValueError(f"two HF keys map to {name!r}: {slots} and {key!r}")
            slots[slot] = key
        plan = {}
        for name, slots in parts.items():
            if -1 in slots:
                plan[name] = Source((slots[-1],), "copy")
            elif set(slots) == {0, 1}:
                plan[name] = Source((slots[0], slots[1]), "cat0")
            else:
                raise ValueError(f"{name!r} needs both gate and up tensors, found only {list(slots.values())}")
        return plan

    def plan_to_hf(self, mg_keys: Iterable[str], num_layers: Optional[int] = None,
                   mtp_copies: Optional[Iterable[str]] = None) -> dict[str, Source]:
        """HF key -> how to take it from the Megatron keys. MTP layers get HF copies of the shared
        embedding and output layer (``embed_tokens``, ``shared_head.head``): the HF keys named in
        ``mtp_copies`` (those a conversion left out), or, with None (a checkpoint from elsewhere),
        both for every MTP layer whose Megatron keys carry none of their own."""
        mg_keys = list(mg_keys)
        plan: dict[str, Source] = {}
        for key in mg_keys:
            names = self.mg_to_hf(key, num_layers)
            for i, name in enumerate(names):
                if name in plan:
                    raise ValueError(f"two Megatron keys map to {name!r}: {plan[name].keys[0]!r} and {key!r}")
                plan[name] = Source((key,), "copy" if len(names) == 1 else f"half{i}")
        if self.family == "mla":
            present = set(mg_keys)
            mtp_copies = None if mtp_copies is None else set(mtp_copies)
            n_layers = self.num_layers if num_layers is None else num_layers
            mtp_ids = {int(m.group("L")) for k in mg_keys if (m := self._mg_mtp.match(k))}
            for i in sorted(mtp_ids):
                for rel, (_, shared_mg) in _MTP_SHARED.items():
                    name = f"{_LAYER_PREFIX['mla']}{n_layers + i}.{rel}"
                    wanted = mtp_copies is None or name in mtp_copies
                    if wanted and name not in plan and shared_mg in present:
                        plan[name] = Source((shared_mg,), "clone")
        return plan

    def mtp_shared_copies(self, hf_keys: Iterable[str]) -> dict[str, str]:
        """HF MTP-layer keys that copy a shared tensor -> that tensor's HF key (``embed_tokens`` of
        the embedding, ``shared_head.head`` of ``lm_head``): megatron's MTP has no parameter of its
        own for them. Only for keys whose shared tensor is among ``hf_keys``."""
        hf_keys = set(hf_keys)
        out = {}
        if self.family != "mla" or self.num_layers is None:
            return out
        for key in hf_keys:
            m = self._hf_layer.match(key)
            if m and int(m.group("L")) >= self.num_layers and m.group("rest") in _MTP_SHARED:
                shared = _MTP_SHARED[m.group("rest")][0]
                if shared in hf_keys:
                    out[key] = shared
        return out


def detect_family(keys: Iterable[str], model_type: Optional[str] = None) -> str:
    """"v4" for DeepSeek-V4 (config ``model_type`` or its ``attn.wkv`` / ``attn_sink`` keys), else "mla"."""
    if model_type is not None:
        return "v4" if model_type.startswith("deepseek_v4") else "mla"
    for k in keys:
        if ".attn.wkv." in k or k.endswith(".attn.attn_sink") or k.endswith("self_attention.linear_kv_proj.weight"):
            return "v4"
    return "mla"


def moe_layers_of(keys: Iterable[str]) -> set[int]:
    """Layer indices whose keys show a router (HF ``mlp.gate`` / ``ffn.gate``, Megatron ``mlp.router``)."""
    pat = re.compile(r"(?:model\.layers|^layers|decoder\.layers)\.(\d+)\.(?:mlp\.gate\.|ffn\.gate\.|mlp\.router\.)")
    out = set()
    for k in keys:
        m = pat.search(k)
        if m:
            out.add(int(m.group(1)))
    return out
