"""Megatron-core in one CPU process: gloo, world size 1, and the small shims megatron needs there.

- RoPE and the indexer-loss tracker call ``torch.cuda.current_device()``: answer "cpu".
- ``multi_latent_attention.HAVE_TE`` is True even without Transformer Engine (its import shims
  succeed); set it False so MLA takes the local code paths.
- ``moe_utils.te_general_gemm`` is never defined without TE (the router's gating GEMM reads it).
"""

from __future__ import annotations

import importlib.util
import pathlib
import socket

import pytest
import torch


def _megatron_mode():
    """"specs" (0.16.x: our modules), "backend" (0.19.x: megatron's DSA with our backend), or None."""
    if importlib.util.find_spec("megatron") is None:
        return None
    try:
        from dsa_plugins.adapters.megatron import megatron_mode

        return megatron_mode()
    except Exception:
        return None


# Each megatron generation has its own tests: test_megatron019_* for 0.19.x, the others for 0.16.x.
_HERE = pathlib.Path(__file__).parent
_V019 = sorted(p.name for p in _HERE.glob("test_megatron019_*.py"))
collect_ignore = (
    sorted(p.name for p in _HERE.glob("test_*.py") if p.name not in _V019)
    if _megatron_mode() == "backend" else _V019
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def megatron_env():
    pytest.importorskip("megatron.core")
    pytest.importorskip("einops")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mp = pytest.MonkeyPatch()
    if not torch.cuda.is_available():
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        mp.setattr(mla, "HAVE_TE", False)
        if not hasattr(moe_utils, "te_general_gemm"):  # left undefined when TE is missing
            mp.setattr(moe_utils, "te_general_gemm", None, raising=False)

    created = False
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        created = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    try:
        model_parallel_cuda_manual_seed(123)
    except Exception:  # the CUDA RNG tracker is optional on CPU
        pass
    yield
    ps.destroy_model_parallel()
    if created:
        dist.destroy_process_group()
    mp.undo()


@pytest.fixture
def tiny_config(megatron_env):
    """Factory of tiny MLA + DSA configs (fp32, local modules, CPU initialisation)."""
    return _tiny_mla_config


def _tiny_mla_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=8,
        rope_type="rope",
        rotary_base=10000,
        normalization="RMSNorm",
        qk_layernorm=True,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=8,
        dsa_indexer_head_dim=16,
        dsa_indexer_topk=5,
        dsa_indexer_loss_coeff=1.0,
        dsa_indexer_use_sparse_loss=False,
        transformer_impl="local",
        params_dtype=torch.float32,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.2,
    )
    kw.update(overrides)
    return MLATransformerConfig(**kw)
