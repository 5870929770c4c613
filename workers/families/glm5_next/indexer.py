"""glm5_next's DSA indexer, chunked over queries so a long sequence never builds a T×T tensor.

transformers' `Glm5NextTextIndexer.forward` scores every query against every k-pool at once ([B, T, heads, T/kpool])
and builds a [B, T, T] visibility mask: at 32K tokens that alone runs out of memory before attention starts. This
subclass computes the same selection (same projections, pooling, tail and padding rules; the stock helpers are
reused) one block of queries at a time, sized so each block's intermediates stay under CHUNK_ELEMENTS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

CHUNK_ELEMENTS = 1 << 24  # bound on a block's [B, rows, keys] / [B, rows, heads, pools] intermediates


class ChunkedGlm5NextIndexer(Glm5NextTextIndexer):
    @torch.no_grad()
    def forward(self, hidden_states, q_resid, attention_mask, cache=None):
        """Stock contract: int32 top-k token indices [B, T, topk (+ kpool - 1 with the tail)], -1 = none."""
        batch, seq_len = hidden_states.shape[:2]
        q = self.wq_b(q_resid).view(batch, seq_len, -1, self.head_dim).float()
        k = self.k_norm(self.wk(hidden_states)).view(batch, seq_len, -1, self.head_dim).squeeze(2)
        gate_scores = F.linear(hidden_states, self.index_kpool_compress_gate)
        packed = torch.cat([k, gate_scores, attention_mask.to(k.dtype)[..., None]], dim=-1)
        kv_len = current_length = seq_len
        if cache is not None:
            packed = cache.update_indexer(packed, self.layer_idx)
            kv_len = cache.layers[self.layer_idx].keys.shape[-2]
            current_length = cache.layers[self.layer_idx].get_seq_length()
        valid_keys = packed[..., -1].bool()
        pool_keys, pool_indices, pool_valid = self.get_pooled_states(packed_states=packed)
        pool_keys = pool_keys.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, P]
        pool_end = pool_indices[..., -1].clamp(0, kv_len - 1)
        n_pools = pool_indices.shape[1]
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
        select_k = min(self.index_topk // self.index_kpool, n_pools)
        width = self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)
        batch_idx = torch.arange(batch, device=hidden_states.device)[:, None, None]
        key_pos = torch.arange(valid_keys.shape[-1], device=hidden_states.device)
        rows = max(1, CHUNK_ELEMENTS // (batch * max(valid_keys.shape[-1], self.n_heads * n_pools)))
        out = torch.full((batch, seq_len, width), -1, dtype=torch.int32, device=hidden_states.device)
        for start in range(0, seq_len, rows):
            stop = min(seq_len, start + rows)
            q_pos = current_length - seq_len + torch.arange(start, stop, device=hidden_states.device)
            visible = (key_pos[None, None, :] <= q_pos[None, :, None]) & valid_keys[:, None, :]
            scores = F.relu(torch.matmul(q[:, start:stop], pool_keys) * self.softmax_scale)
            index_scores = torch.matmul(weights[:, start:stop].unsqueeze(-2), scores).squeeze(-2)
            candidates = visible.gather(-1, pool_end[:, None, :].expand(batch, stop - start, -1)) & pool_valid[:, None]
            index_scores = index_scores.masked_fill(~candidates, torch.finfo(index_scores.dtype).min)
            selected = index_scores.topk(select_k, dim=-1).indices
            chosen = pool_indices[batch_idx, selected]  # [B, rows, select_k, kpool] token ids
            chosen = chosen.masked_fill(~candidates.gather(-1, selected)[..., None], -1).flatten(-2)
            if self.index_kpool_always_select_tail:
                chosen = self.append_visible_tail(chosen, visible, valid_keys)
            chosen = chosen[..., :width].masked_fill(~attention_mask[:, start:stop, None], -1)
            out[:, start:stop, :chosen.shape[-1]] = chosen.to(torch.int32)
        return out
