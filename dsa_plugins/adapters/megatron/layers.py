"""Small building blocks shared by the Megatron-core DSA modules.

- :class:`DuplicatedLinear`: a linear layer whose weight is replicated on every tensor-parallel
  rank (megatron's ``parallel_mode="duplicated"``), for the indexer projections when Transformer
  Engine (whose ``TELinear`` megatron's DSA spec asks for) is not installed.
- :func:`hadamard_rotate`: the orthonormal Hadamard rotation DeepSeek-V3.2 applies to indexer
  queries and keys before fp8 quantisation, in plain torch (``fast_hadamard_transform`` is used
  when present). It preserves dot products, so it changes index scores only by rounding.
- :func:`rope_config`: a config view that makes megatron's ``apply_rotary_pos_emb`` use the
  interleaved-pair (DeepSeek MLA / GLM-5 indexer) or the half-split (DeepSeek-V3.2 indexer) layout.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from ...common.settings import deterministic

try:  # optional CUDA kernel; the torch path below gives the same result
    from fast_hadamard_transform import hadamard_transform as _fast_hadamard
except ImportError:  # pragma: no cover - depends on the machine
    _fast_hadamard = None


class DuplicatedLinear(MegatronModule):
    """``y = x @ W.T (+ b)`` with ``W`` replicated on every TP rank; returns ``(y, bias)`` like
    megatron's linear layers (``bias`` is returned instead of added when ``skip_bias_add``).

    Accepts the keyword arguments megatron's DSA indexer passes to its linears (``init_method``,
    ``bias``, ``skip_bias_add``, ``skip_weight_param_allocation``, ``parallel_mode``, ...)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method=None,
        bias: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        parallel_mode: str | None = "duplicated",
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        if parallel_mode not in (None, "duplicated"):
            raise ValueError(f"DuplicatedLinear supports parallel_mode='duplicated' only, got {parallel_mode!r}")
        if skip_weight_param_allocation:
            raise ValueError("DuplicatedLinear always allocates its weight")
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        )
        if config.perform_initialization:
            (init_method or config.init_method)(self.weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, dtype=config.params_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor):
        weight = self.weight
        if x.dtype != weight.dtype and not torch.is_autocast_enabled():
            weight = weight.to(x.dtype)
        if self.skip_bias_add:
            return torch.nn.functional.linear(x, weight), self.bias
        return torch.nn.functional.linear(x, weight, self.bias), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, None, sharded_offsets)


def _hadamard_torch(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform along the last dim (a power of two)."""
    n = x.shape[-1]
    shape = x.shape
    out = x.reshape(-1, n)
    h = 1
    while h < n:
        out = out.view(-1, n // (2 * h), 2, h)
        a, b = out[:, :, 0, :], out[:, :, 1, :]
        out = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return out.reshape(shape)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Hadamard rotation of the last dimension (size a power of two)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"hadamard_rotate needs a power-of-two last dimension, got {n}")
    if _fast_hadamard is not None and x.is_cuda and x.dtype == torch.bfloat16:
        return _fast_hadamard(x.contiguous(), scale=n**-0.5)
    return (_hadamard_torch(x.float()) * (n**-0.5)).to(x.dtype)


def rope_config(config, interleaved: bool):
    """A shallow copy of ``config`` for megatron's ``apply_rotary_pos_emb``.

    ``interleaved=True``: rotate the pairs (x0, x1), (x2, x3), ... (DeepSeek MLA and GLM-5 indexer;
    megatron's MLA path). ``interleaved=False``: rotate (x_i, x_{i + d/2}) (DeepSeek-V3.2 indexer).
    Fused RoPE is turned off (it supports neither choice explicitly)."""
    cfg = copy.copy(config)
    cfg.multi_latent_attention = bool(interleaved)
    cfg.rotary_interleaved = False
    cfg.apply_rope_fusion = False
    return cfg


class _FixedEps:
    """Base of :func:`norm_with_eps` classes: build ``base`` with a fixed ``eps`` whatever the
    caller passes (megatron builds q/kv norms with ``config.layernorm_epsilon``)."""

    base: Any = None
    fixed_eps: float = 1e-6

    def __new__(cls, *args, eps=None, **kwargs):
        return cls.base(*args, eps=cls.fixed_eps, **kwargs)


def norm_with_eps(base, eps: float):
    """A module class that builds the norm class ``base`` with ``eps`` (e.g. 1e-6 for
    DeepSeek/GLM ``q_a_layernorm`` / ``kv_a_layernorm`` while other norms use rms_norm_eps)."""
    return type(f"{getattr(base, '__name__', 'Norm')}Eps", (_FixedEps,), {"base": base, "fixed_eps": float(eps)})


def yarn_mscale(scale: float, mscale: float) -> float:
    """DeepSeek's YaRN attention-scale correction (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def deterministic_for(config):
    """:func:`dsa_plugins.deterministic` where megatron's ``config.deterministic_mode`` is set (megatron's
    switch for reproducible kernels), else nothing: the attention ops' backward is then bitwise reproducible."""
    return deterministic() if getattr(config, "deterministic_mode", False) else contextlib.nullcontext()
