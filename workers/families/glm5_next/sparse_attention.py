"""glm5_next's indexed (DSA) attention on kernels/sparse_attention instead of a dense T×S mask.

transformers turns each layer's top-k indices into a dense boolean/additive mask and runs full attention under it.
The swap keeps the model's own projections and cross-layer index sharing, and changes four things on each
indexed-attention module: its indexer becomes the query-chunked one (indexer.py: same selection, no T×T tensor),
the indices are handed through unchanged instead of becoming a mask, the latent is not expanded per head, and the
attention call resolves to `moetune_sparse`, which attends over the selected tokens' latent only (families/mla.py).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention

from moetune.workers.families.context import GATHERS_KEYS
from moetune.workers.families.glm5_next.indexer import ChunkedGlm5NextIndexer
from moetune.workers.families.mla import mla_sparse_attention, use_latent_kv

ATTN_IMPLEMENTATION = "moetune_sparse"


def _sparse_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **_):
    """transformers attention-interface signature: query [B, H, T, D], key/value the latent (mla.py);
    `attention_mask` carries the int top-k indices [B, T, K] (-1 = none) from the patched mask builder.
    Returns ([B, T, H, Dv], None)."""
    if attention_mask is None or attention_mask.is_floating_point() or attention_mask.dtype == torch.bool:
        raise TypeError(f"{ATTN_IMPLEMENTATION} attention needs top-k indices; only swapped indexed-attention "
                        "modules can use it")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention has no attention dropout (got {dropout})")
    return mla_sparse_attention(module, query, key, value, attention_mask, scaling), None


def _indices_as_mask(topk_indices, query_states, kv_length):
    return topk_indices


def _register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, _sparse_attention_forward)


def apply_sparse_attention_kernels(model, backend: str | None = None) -> int:
    """Route every glm5_next indexed-attention module of `model` through the sparse kernel; returns how many
    changed (0 on a second call).
    backend: None picks by device (Triton on CUDA), or "triton" / "torch".

    The text config's attention implementation becomes `moetune_sparse` (the vision tower has its own config); a
    model passed in part would leave unswapped layers on that config, which then fail with a clear TypeError."""
    modules = [m for m in model.modules() if isinstance(m, Glm5NextTextAttention)
               and m.__dict__.get("build_attention_mask_from_topk") is not _indices_as_mask]  # idempotent
    if not modules:
        return 0
    _register()
    for module in modules:
        module.build_attention_mask_from_topk = _indices_as_mask
        if module.indexer is not None:  # a "shared" layer reuses the previous layer's indices
            module.indexer.__class__ = ChunkedGlm5NextIndexer
        module.sparse_attention_backend = backend
        use_latent_kv(module)
        setattr(module, GATHERS_KEYS, True)  # its latent and indexer keys go through `cache`: a CP path
        module.config._attn_implementation = ATTN_IMPLEMENTATION
    return len(modules)
