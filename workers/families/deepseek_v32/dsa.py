"""DeepSeek-V3.2's sparse attention without a T×T tensor: the kernel swap of the deepseek_v32 family.

transformers builds a [B, 1, T, T] causal mask for every forward, scores every query against every key at once in
its indexer ([B, T, 64 heads, T] fp32: ~275 GB at 32K), and runs dense attention under a top-k mask. The swap puts
each DSA attention module on the `moetune_dsa` implementation:
- the causal mask becomes a `RowMask`, which builds the same mask a block of query rows at a time, on demand;
- the indexer selects with `kernels.sparse_attention.select_topk` one block of queries at a time, blocks sized to
  the free memory (same projections, RoPE and scores as transformers', the -inf of invisible keys turned into -1
  slots);
- attention runs `kernels.sparse_attention.sparse_attention` over the selected tokens' latent, not expanded per
  head (families/mla.py; transformers hands the top-k indices to any implementation other than eager/SDPA).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32Indexer,
    apply_rotary_pos_emb,
)

from moetune.kernels.sparse_attention import select_topk
from moetune.workers.families.mla import mla_sparse_attention, use_latent_kv

ATTN_IMPLEMENTATION = "moetune_dsa"


class RowMask:
    """The causal (+ padding) mask transformers would build, [B, 1, q, kv], materialized a block of query rows at
    a time. Indexing it (the attention takes `mask[:, 0, :, :]`) returns itself."""

    def __init__(self, **mask_kwargs):
        self.kwargs = {**mask_kwargs, "allow_is_causal_skip": False}
        self.q_length, self.q_offset = mask_kwargs["q_length"], mask_kwargs.get("q_offset", 0)

    def __getitem__(self, index):
        return self

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """bool [B, stop - start, kv]: the keys query rows start..stop-1 may see."""
        block = sdpa_mask(**{**self.kwargs, "q_length": stop - start, "q_offset": self.q_offset + start})
        return block[:, 0]


class ChunkedDeepseekV32Indexer(DeepseekV32Indexer):
    @torch.no_grad()
    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None, cache=None):
        """Stock contract (int32 top-k key indices [B, S, topk]), -1 in the slots of keys a query cannot see."""
        batch, seq_len, _ = hidden_states.shape
        q = self.wq_b(q_resid).view(batch, seq_len, self.n_heads, self.head_dim)
        q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
        k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if cache is not None:
            k = cache.update_indexer(k, self.layer_idx)
        # weights_proj runs in its own dtype (fp32 in transformers); a checkpoint that quantized it keeps no weight
        dtype = getattr(self.weights_proj.weight, "dtype", hidden_states.dtype)
        weights = self.weights_proj(hidden_states.to(dtype)).float() * self.n_heads ** -0.5
        if isinstance(attention_mask, RowMask):
            visible = attention_mask.rows
        else:  # a materialized [B, S, T] mask (bool, or additive)
            def visible(start, stop):
                block = attention_mask[:, start:stop]
                return block if block.dtype == torch.bool else block > torch.finfo(block.dtype).min / 2
        return select_topk(q, k, weights, self.index_topk, self.softmax_scale, visible)


def _row_mask(**kwargs) -> RowMask:
    return RowMask(**kwargs)


def _dsa_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, indices=None, **_):
    """transformers attention-interface signature: query [B, H, T, D], key/value the latent (mla.py); `indices`
    [B, T, K] (-1 = none) from the indexer. Returns ([B, T, H, Dv], None)."""
    if indices is None:
        raise TypeError(f"{ATTN_IMPLEMENTATION} attention needs the indexer's top-k indices")
    if dropout:
        raise ValueError(f"{ATTN_IMPLEMENTATION} attention has no attention dropout (got {dropout})")
    return mla_sparse_attention(module, query, key, value, indices, scaling), None


def apply_dsa_kernels(model, backend: str | None = None) -> int:
    """Every DeepSeek-V3.2 DSA attention module of `model` on the chunked indexer and the sparse kernel; returns
    how many changed (0 on a second call). backend: None picks by device (Triton on CUDA), or "triton" / "torch".
    The model's config switches to `moetune_dsa` (so its mask is a RowMask)."""
    modules = [m for m in model.modules()
               if isinstance(m, DeepseekV32Attention) and not isinstance(m.indexer, ChunkedDeepseekV32Indexer)]
    if not modules:
        return 0
    AttentionInterface.register(ATTN_IMPLEMENTATION, _dsa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _row_mask)
    for module in modules:
        module.indexer.__class__ = ChunkedDeepseekV32Indexer
        module.sparse_attention_backend = backend
        use_latent_kv(module)
        module.config._attn_implementation = ATTN_IMPLEMENTATION
    return len(modules)
