"""The DSA indexer's selection: ReLU-weighted scores of each query against the keys it may see, then its top-k.

Selection carries no gradient (the indexer is trained by its own loss, if at all), so this runs under no_grad and
processes queries in chunks that keep the [chunk, heads, keys] intermediate bounded. One implementation for every
family: DeepSeek-style indexers pass one key per token and the default causal visibility; glm5_next passes pooled
keys and its own visibility (workers/families/glm5_next/indexer.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_CHUNK_ELEMENTS = 1 << 25  # bound on the per-chunk [B, tc, H, S] score tensor


def _causal(q_len: int, kv_len: int, device) -> Callable[[int, int], torch.Tensor]:
    key_pos = torch.arange(kv_len, device=device)

    def visible(start: int, stop: int) -> torch.Tensor:
        q_pos = kv_len - q_len + torch.arange(start, stop, device=device)
        return (key_pos[None, :] <= q_pos[:, None])[None]

    return visible


@torch.no_grad()
def select_topk(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor, topk: int, scale: float = 1.0,
                visible: Callable[[int, int], torch.Tensor] | None = None, rows: int | None = None) -> torch.Tensor:
    """Indices [B,T,topk] (int32) of the best-scoring keys for each query, score_s = Σ_h w_h·ReLU(scale·q_h·k_s);
    -1 fills the slots of queries that see fewer than topk keys. q_idx [B,T,H,D], k_idx [B,S,D], weights [B,T,H].

    `visible(start, stop)`: bool [B or 1, stop - start, S], the keys queries start..stop-1 may select; default
    causal, query t sitting at position S - T + t. `rows`: queries per chunk (default: a bound on [rows, H, S])."""
    batch, q_len, heads, _ = q_idx.shape
    kv_len = k_idx.shape[1]
    visible = visible or _causal(q_len, kv_len, q_idx.device)
    width = min(topk, kv_len)
    chunk = rows or max(1, _CHUNK_ELEMENTS // max(1, batch * heads * kv_len))
    out = torch.full((batch, q_len, topk), -1, dtype=torch.int32, device=q_idx.device)
    k_t = k_idx.float().transpose(-1, -2).unsqueeze(1)  # [B, 1, D, S]
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        logits = torch.relu(torch.matmul(q_idx[:, start:stop].float(), k_t) * scale)  # [B, tc, H, S]
        scores = torch.matmul(weights[:, start:stop].float().unsqueeze(-2), logits).squeeze(-2)  # [B, tc, S]
        scores = scores.masked_fill(~visible(start, stop), float("-inf"))
        best, idx = scores.topk(width, dim=-1)
        out[:, start:stop, :width] = torch.where(best > float("-inf"), idx, -1).to(torch.int32)
    return out
