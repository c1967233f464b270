"""Torch implementations of every op: the oracle the kernels are tested against, and the CPU path."""

from .indexer import causal_key_windows, indexer_scores, indexer_topk_reference, topk_rows_reference
from .indexer_loss import indexer_kl_loss_reference
from .mla import project_values
from .sparse_attention import (
    sparse_attention_backward,
    sparse_attention_dense,
    sparse_attention_forward,
    sparse_attention_reference,
)

__all__ = [
    "causal_key_windows",
    "indexer_kl_loss_reference",
    "indexer_scores",
    "indexer_topk_reference",
    "project_values",
    "sparse_attention_backward",
    "sparse_attention_dense",
    "sparse_attention_forward",
    "sparse_attention_reference",
    "topk_rows_reference",
]
