"""Oracles: the indexer and the attention written the plain, dense way (a T×S score matrix and a boolean mask)."""

from __future__ import annotations

import torch


def indexer_scores_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s]); q_idx [B,T,H,D], k_idx [B,S,D], weights [B,T,H]."""
    logits = torch.einsum("bthd,bsd->bths", q_idx.float(), k_idx.float()).relu()
    return torch.einsum("bths,bth->bts", logits, weights.float())


def topk_mask(indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B,T,K] indices (-1 = none) -> [B,T,S] boolean mask of the selected keys."""
    slots = torch.where(indices >= 0, indices.long(), kv_len)  # invalid -> a spare column, dropped below
    mask = torch.zeros(*indices.shape[:2], kv_len + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(-1, slots, True)
    return mask[..., :kv_len]


def sparse_attention_reference(q, k, v, indices, scale: float, gate=None) -> torch.Tensor:
    """Dense attention restricted by the top-k mask, in fp32. Shapes: q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv],
    indices [B,T,K]. A query with no valid index gets a zero output. `gate` (broadcastable to the output) multiplies
    the attention output by sigmoid(gate)."""
    group = q.shape[2] // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale
    mask = topk_mask(indices, k.shape[1])[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0
    out = torch.einsum("bhts,bshd->bthd", probs, vf)
    if gate is not None:
        out = out * torch.sigmoid(gate.float())
    return out.to(q.dtype)
