"""The DeepSeek-V3.2 family under ``dsa_tilelang``: deepseek_v32, glm_moe_dsa (GLM-5), axk2,
hy_v4 (with sinks), hy_v4_vl (its vision-language release: the text model; the vision tower runs SDPA),
mistral_large4 (text) and dots3_note (text).

Two patches per model, both inert unless the model runs under dsa_tilelang:

* ``*Attention.expand_kv`` keeps the MLA latent (:func:`~..attention.wrap_expand_kv`), so the
  attention function runs absorbed sparse MLA;
* ``*Indexer.forward`` projects q, k and the head weights as the model does (the only part that
  differs between models: a *projection* below) and selects through the fused
  ``indexer_topk`` (:func:`~..indexer.select_topk`): no ``[B, S, T]`` score tensor.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch

from ....common.settings import warn_once
from ....patches.attributes import PatchPointMissing, class_in, own_attributes, patch_attribute
from ..attention import wrap_expand_kv
from ..constants import PATCH_KEY
from ..indexer import indexer_binder, indexer_cache, select_topk
from ..index_keys import fp8_index_cache_enabled
from ..indexer_loss import SERVED_MARKER, loss_handle, stash_loss
from ..masks import LazyMask

__all__ = ["mistral_large4_projection", "patcher", "rope_first_projection"]


def _rope_fn(indexer, name: str) -> Callable:
    fn = getattr(sys.modules[type(indexer).__module__], name, None)
    if fn is None:
        raise PatchPointMissing(f"dsa_tilelang: {type(indexer).__module__}.{name} is missing")
    return fn


def rope_first_projection(rope_name: str, rope_first: bool = True):
    """Indexer projections of the DeepSeek-V3.2 kind (q from ``q_resid``), parametrised by the rope
    function, where the rope slice sits (first or last dims), and the k_norm dtype handling."""

    def project(indexer, hidden_states, q_resid, position_embeddings, position_ids):
        B, S, _ = hidden_states.shape
        Hi, Di, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
        cos, sin = position_embeddings
        q = indexer.wq_b(q_resid).view(B, S, Hi, Di)
        k_in = indexer.wk(hidden_states)
        if rope_first:
            k = indexer.k_norm(k_in).unsqueeze(2)
        else:  # hy_v4 keeps its k_norm in fp32
            k = indexer.k_norm(k_in.to(indexer.k_norm.weight.dtype)).to(hidden_states.dtype).unsqueeze(2)
        split = [R, Di - R] if rope_first else [Di - R, R]
        q_a, q_b = torch.split(q, split, dim=-1)
        k_a, k_b = torch.split(k, split, dim=-1)
        rope = _rope_fn(indexer, rope_name)
        if rope_first:
            q_a, k_a = rope(q_a, k_a, cos, sin, unsqueeze_dim=2)
        else:
            q_b, k_b = rope(q_b, k_b, cos, sin, unsqueeze_dim=2)
        # back to the projection's dtype: fp32 cos / sin (dots3_note's) promote the rope slice, and the kernels
        # take bf16 / fp16 (the model's own indexer scores in fp32 after its rope either way). k too, before the
        # cache: the kernels read it in that dtype, so an fp32 index cache would only double its memory and be
        # cast whole at every step
        q = torch.cat([q_a, q_b], dim=-1).to(q.dtype)
        k = torch.cat([k_a, k_b], dim=-1).squeeze(2).to(q.dtype)
        w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
        w = w * (Hi**-0.5) * indexer.softmax_scale  # relu(c*x) = c*relu(x) for c > 0
        return q, k, w

    return project


def mistral_large4_projection(indexer, hidden_states, q_resid, position_embeddings, position_ids):
    B, S, _ = hidden_states.shape
    Hi, Di, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    q = indexer.wq_b(indexer.q_input_norm(hidden_states)).view(B, S, Hi, Di)
    q = indexer.softmax_scaling(q, position_ids, head_dim_first=False)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    if indexer.use_rope:
        cos, sin = position_embeddings
        q_rot, q_pass = torch.split(q, [R, Di - R], dim=-1)
        k_rot, k_pass = torch.split(k, [R, Di - R], dim=-1)
        q_rot, k_rot = _rope_fn(indexer, "apply_rotary_pos_emb_interleave")(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1).to(q_pass.dtype)  # as in rope_first_projection
        k = torch.cat([k_rot, k_pass], dim=-1)
    k = k.squeeze(2).to(q.dtype)
    w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, w * (Hi**-0.5) * indexer.softmax_scale


def _wrap_indexer_forward(original: Callable, project: Callable) -> Callable:
    bind = indexer_binder(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        a = bind((self, *args), kwargs)
        cache = indexer_cache(a)
        mask = a.get("attention_mask")
        if not isinstance(mask, LazyMask):  # not our implementation (or a user-built 4D mask)
            if fp8_index_cache_enabled(self):
                warn_once("hf:fp8_index_unserved", "dsa_tilelang: the fp8 index cache is on, but this indexer call "
                          "has no dsa_tilelang mask (another attention implementation or a 4D mask): it runs the "
                          "model's own bf16 indexer")
            return original(self, *args, **kwargs)
        handle = loss_handle(self, mask, a["hidden_states"].shape[1])
        if handle is None:
            with torch.no_grad():
                q, k, w = project(
                    self, a["hidden_states"], a.get("q_resid"), a["position_embeddings"], a.get("position_ids")
                )
                return select_topk(self, q, k, w, mask, cache)
        # indexer loss on: the projections keep their graph (on inputs detached from the model, so the
        # loss trains the indexer only); the selection itself is not differentiable
        q_resid = a.get("q_resid")
        q, k, w = project(self, a["hidden_states"].detach(), None if q_resid is None else q_resid.detach(),
                          a["position_embeddings"], a.get("position_ids"))
        with torch.no_grad():
            selected, index_lse = select_topk(self, q.detach(), k.detach(), w.detach(), mask, cache, return_lse=True)
        stash_loss(self, handle, q, k, w, mask, index_lse)
        return selected

    setattr(forward, SERVED_MARKER, True)  # enable_indexer_loss serves this indexer
    return forward


def patcher(model_type: str, attention: str, indexer: str, project: Callable) -> Callable:
    """The patch function of one V3.2-family model: ``attention`` / ``indexer`` name its classes in
    the modeling module, ``project(indexer, hidden_states, q_resid, position_embeddings,
    position_ids) -> (q [B,S,Hi,Di], k [B,S,Di], weights [B,S,Hi] fp32)`` its indexer projections."""

    def patch(module) -> None:
        key = f"{PATCH_KEY}.{model_type}"
        attn_cls, idx_cls = class_in(module, attention), class_in(module, indexer)
        (expand_kv,) = own_attributes(attn_cls, "expand_kv")
        (forward,) = own_attributes(idx_cls, "forward")
        patch_attribute(attn_cls, "expand_kv", wrap_expand_kv(expand_kv), key=key)
        patch_attribute(idx_cls, "forward", _wrap_indexer_forward(forward, project), key=key)

    patch.__qualname__ = f"patch_{model_type}"
    return patch
