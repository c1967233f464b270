"""dsa_plugins: fast DeepSeek Sparse Attention for Hugging Face Transformers and Megatron-core.

Public ops live in :mod:`dsa_plugins.ops` (re-exported here); framework adapters in
:mod:`dsa_plugins.hf` and :mod:`dsa_plugins.megatron` (imported on demand).
"""

from .ops import (
    DeepSeekV4SparseAttention,
    DeepSeekV4SparseAttentionHeadChunked,
    causal_key_windows,
    indexer_kl_loss,
    indexer_topk,
    is_dsa_kernel_available,
    should_use_tilelang,
    sparse_attention,
    sparse_attention_head_chunked,
    sparse_attn_tilelang,
    sparse_attn_tilelang_head_chunked,
    sparse_mla,
    tilelang_indexer_topk,
    tilelang_sparse_attention,
    topk_rows,
)

__version__ = "0.1.0"

__all__ = [
    "DeepSeekV4SparseAttention",
    "DeepSeekV4SparseAttentionHeadChunked",
    "__version__",
    "causal_key_windows",
    "indexer_kl_loss",
    "indexer_topk",
    "is_dsa_kernel_available",
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
