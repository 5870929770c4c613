"""glm5_next's DSA indexer, chunked over queries so a long sequence never builds a T×T tensor.

transformers' `Glm5NextTextIndexer.forward` scores every query against every k-pool at once ([B, T, heads, T/kpool])
and builds a [B, T, T] visibility mask: at 32K tokens that alone runs out of memory before attention starts. This
subclass computes the same selection (same projections, pooling, tail and padding rules; the stock helpers are
reused) with the kernels' chunked indexer over the pooled keys, one block of queries at a time, sized so each
block's intermediates (up to 8 bytes an element) fit the indexer's memory budget (kernels.sparse_attention.indexer).

In a context-parallel forward (workers.families.context) its cache is the CP group's `GatheredKeys`: the slice's
queries select among the whole row's keys, pooled over the row as the unsplit layer pools them, each seeing the
keys up to its own global position; the indices it returns are positions in the row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

from moetune.kernels.sparse_attention import select_topk
from moetune.kernels.sparse_attention.indexer import chunk_rows
from moetune.workers.comm.mla_context import GatheredKeys


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
        if isinstance(cache, GatheredKeys):  # the row's keys; the slice's queries end where the slice ends
            packed = cache.update_indexer(packed, self.layer_idx)
            kv_len, current_length = packed.shape[1], cache.layout.end
        elif cache is not None:
            packed = cache.update_indexer(packed, self.layer_idx)
            kv_len = cache.layers[self.layer_idx].keys.shape[-2]
            current_length = cache.layers[self.layer_idx].get_seq_length()
        valid_keys = packed[..., -1].bool()
        pool_keys, pool_indices, pool_valid = self.get_pooled_states(packed_states=packed)
        pool_end = pool_indices[..., -1].clamp(0, kv_len - 1)
        # weights_proj runs in its own dtype (fp32 in transformers); a checkpoint that quantized it keeps no weight
        dtype = getattr(self.weights_proj.weight, "dtype", hidden_states.dtype)
        weights = self.weights_proj(hidden_states.to(dtype)).float() * self.n_heads ** -0.5
        select_k = min(self.index_topk // self.index_kpool, pool_indices.shape[1])
        width = self.index_topk + (self.index_kpool - 1 if self.index_kpool_always_select_tail else 0)
        key_pos = torch.arange(valid_keys.shape[-1], device=hidden_states.device)

        def visible(start: int, stop: int):  # [B, rows, keys]: keys that queries start..stop-1 may see
            q_pos = current_length - seq_len + torch.arange(start, stop, device=hidden_states.device)
            return (key_pos[None, None, :] <= q_pos[None, :, None]) & valid_keys[:, None, :]

        def candidates(start: int, stop: int):  # [B, rows, pools]: a pool is selectable once its last key is visible
            ends = pool_end[:, None, :].expand(batch, stop - start, -1)
            return visible(start, stop).gather(-1, ends) & pool_valid[:, None]

        widest = max(valid_keys.shape[-1], self.n_heads * pool_indices.shape[1])  # [rows, keys], [rows, heads, pools]
        rows = chunk_rows(seq_len, 8 * batch * widest, hidden_states.device)
        selected = select_topk(q, pool_keys.float(), weights, select_k, self.softmax_scale, candidates, rows).long()
        batch_idx = torch.arange(batch, device=hidden_states.device)[:, None, None]
        out = torch.full((batch, seq_len, width), -1, dtype=torch.int32, device=hidden_states.device)
        for start in range(0, seq_len, rows):  # pools -> their token ids, plus the visible tail
            stop = min(seq_len, start + rows)
            pools = selected[:, start:stop]
            chosen = pool_indices[batch_idx, pools.clamp(min=0)]  # [B, rows, select_k, kpool] token ids
            chosen = chosen.masked_fill((pools < 0)[..., None], -1).flatten(-2)
            if self.index_kpool_always_select_tail:
                chosen = self.append_visible_tail(chosen, visible(start, stop), valid_keys)
            chosen = chosen[..., :width].masked_fill(~attention_mask[:, start:stop, None], -1)
            out[:, start:stop, :chosen.shape[-1]] = chosen.to(torch.int32)
        return out
