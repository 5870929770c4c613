"""The DSA indexer's selection: ReLU-weighted scores of each query against the keys it may see, then its top-k.

Selection carries no gradient (the indexer is trained by its own loss, if at all), so this runs under no_grad and
processes queries in chunks whose [chunk, heads, keys] intermediates fit the memory there is (`chunk_rows`: a share
of the device's free memory on CUDA, CPU_BUDGET_BYTES on the CPU): a fixed element cap left 2 query rows per chunk at
128K keys with 64 index heads, thousands of Python iterations per layer. One implementation for every
family: DeepSeek-style indexers pass one key per token and the default causal visibility; others pass pooled keys
and their own visibility (a family's indexer in its folder, workers/families/<model_type>/).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

CPU_BUDGET_BYTES = 1 << 30  # a chunk's intermediates on the CPU, where free memory says nothing useful
FREE_SHARE = 0.5  # of a CUDA device's free memory: the rest is the caller's and the allocator's fragmentation
ROW_OVERHEAD = 16  # bytes per key and query row beside the [H, S] fp32 logits: scores, their masked copy, masks


def memory_budget(device) -> int:
    """Bytes one chunk's intermediates may take on `device`: FREE_SHARE of what is free on a CUDA device (the
    driver's free memory plus what torch's caching allocator holds unused), CPU_BUDGET_BYTES elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(FREE_SHARE * (free + cached))


def chunk_rows(q_len: int, row_bytes: int, device) -> int:
    """Query rows per chunk when each row's intermediates take `row_bytes`: as many as the budget holds."""
    return max(1, min(q_len, memory_budget(device) // max(1, row_bytes)))


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
    causal, query t sitting at position S - T + t. `rows`: queries per chunk (default: what `chunk_rows` fits)."""
    batch, q_len, heads, _ = q_idx.shape
    kv_len = k_idx.shape[1]
    visible = visible or _causal(q_len, kv_len, q_idx.device)
    width = min(topk, kv_len)
    chunk = rows or chunk_rows(q_len, batch * kv_len * (4 * heads + ROW_OVERHEAD), q_idx.device)
    out = torch.full((batch, q_len, topk), -1, dtype=torch.int32, device=q_idx.device)
    k_t = k_idx.float().transpose(-1, -2).unsqueeze(1)  # [B, 1, D, S]
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        logits = torch.matmul(q_idx[:, start:stop].float(), k_t).mul_(scale).relu_()  # [B, tc, H, S], in place
        scores = torch.matmul(weights[:, start:stop].float().unsqueeze(-2), logits).squeeze(-2)  # [B, tc, S]
        scores = scores.masked_fill(~visible(start, stop), float("-inf"))
        best, idx = scores.topk(width, dim=-1)
        out[:, start:stop, :width] = torch.where(best > float("-inf"), idx, -1).to(torch.int32)
    return out
