"""Public ops: what users call. Every op runs the TileLang kernel or the torch reference by the
backend rules in :mod:`dsa_plugins.ops.backend`."""

from ..common.settings import deterministic
from .backend import is_dsa_kernel_available, should_use_tilelang
from .fused_indexer_loss import FusedIndexerLoss
from .indexer import (
    causal_key_windows,
    indexer_kl_loss,
    indexer_topk,
    quantize_indexer_fp8,
    tilelang_indexer_topk,
    topk_rows,
)
from .sparse_attention import (
    DeepSeekV4SparseAttention,
    DeepSeekV4SparseAttentionHeadChunked,
    sparse_attention,
    sparse_attention_head_chunked,
    sparse_attn_tilelang,
    sparse_attn_tilelang_head_chunked,
    sparse_mla,
    tilelang_sparse_attention,
)

__all__ = [
    "DeepSeekV4SparseAttention",
    "DeepSeekV4SparseAttentionHeadChunked",
    "FusedIndexerLoss",
    "causal_key_windows",
    "deterministic",
    "indexer_kl_loss",
    "indexer_topk",
    "is_dsa_kernel_available",
    "quantize_indexer_fp8",
    "should_use_tilelang",
    "sparse_attention",
    "sparse_attention_head_chunked",
    "sparse_attn_tilelang",
    "sparse_attn_tilelang_head_chunked",
    "sparse_mla",
    "tilelang_indexer_topk",
    "tilelang_sparse_attention",
    "topk_rows",
]
