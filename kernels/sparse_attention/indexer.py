"""The DSA indexer: ReLU-weighted scores against one key per token, then the causal top-k of each query's row.

Selection carries no gradient (the indexer is trained by its own loss, if at all), so this runs under no_grad and
processes queries in chunks that keep the [chunk, heads, keys] intermediate bounded.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 25  # bound on the per-chunk [B, tc, H, S] score tensor


@torch.no_grad()
def select_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices [B,T,topk] (int32) of the best-scoring keys s <= t for each query; -1 fills the slots a short causal
    prefix cannot. q_idx [B,T,H,D], k_idx [B,S,D], weights [B,T,H]; query t sits at position S - T + t."""
    batch, q_len, heads, _ = q_idx.shape
    kv_len = k_idx.shape[1]
    width = min(topk, kv_len)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * kv_len))
    key_pos = torch.arange(kv_len, device=q_idx.device)
    out = torch.full((batch, q_len, topk), -1, dtype=torch.int32, device=q_idx.device)
    k_f = k_idx.float()
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        logits = torch.einsum("bthd,bsd->bths", q_idx[:, start:stop].float(), k_f).relu_()
        scores = torch.einsum("bths,bth->bts", logits, weights[:, start:stop].float())
        q_pos = kv_len - q_len + torch.arange(start, stop, device=q_idx.device)
        future = key_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(future[None], float("-inf"))
        best, idx = scores.topk(width, dim=-1)
        out[:, start:stop, :width] = torch.where(best > float("-inf"), idx, -1).to(torch.int32)
    return out
