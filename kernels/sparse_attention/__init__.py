"""Gated top-k sparse attention (DSA-style): indexer scores, causal top-k selection, attention over the selected
keys only, output gate. `reference` holds the dense-mask oracle."""

from moetune.kernels.sparse_attention.function import sparse_attention
from moetune.kernels.sparse_attention.indexer import select_topk

__all__ = ["select_topk", "sparse_attention"]
