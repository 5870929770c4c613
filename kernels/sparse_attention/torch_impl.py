"""Sparse attention in plain PyTorch: gather the selected K/V rows per query, softmax over them, save the LSE.

This is the CPU path. Queries are processed in chunks so the gathered [chunk, K, ...] rows stay bounded; the
backward recomputes the gathers from the saved LSE (like the kernel) and scatters dK/dV with index_put_.
Layouts: q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv], indices [B,T,K] with -1 = no key.
"""

from __future__ import annotations

import torch

_CHUNK_ELEMENTS = 1 << 24  # bound on the gathered K+V elements per chunk


def _chunk(q, k, v, indices) -> int:
    per_query = indices.shape[0] * indices.shape[2] * k.shape[2] * (k.shape[3] + v.shape[3])
    return max(1, _CHUNK_ELEMENTS // max(1, per_query))


def _gather(k, v, idx):
    """K/V rows for idx [B,tc,K]: ([B,tc,K,Hkv,Dk], [B,tc,K,Hkv,Dv], valid [B,tc,K], safe indices)."""
    valid = idx >= 0
    safe = idx.long().clamp(min=0)
    rows = torch.arange(k.shape[0], device=k.device)[:, None, None]
    return k[rows, safe], v[rows, safe], valid, safe


def _probs(q_c, k_sel, valid, scale, lse=None):
    """Softmax weights [B,tc,Hkv,G,K] (fp32) over the selected keys, and the LSE [B,tc,Hkv,G]."""
    batch, tc, heads, _ = q_c.shape
    hkv = k_sel.shape[3]
    qg = q_c.float().view(batch, tc, hkv, heads // hkv, -1)
    scores = torch.einsum("bthgd,btshd->bthgs", qg, k_sel.float()) * scale
    scores = scores.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # rows without keys: lse = -inf -> 0
    return qg, probs, lse


def forward(q, k, v, indices, scale):
    """Output [B,T,H,Dv] in q's dtype and the LSE [B,T,H] in fp32."""
    batch, q_len, heads, _ = q.shape
    out = q.new_empty(batch, q_len, heads, v.shape[3])
    lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=q.device)
    step = _chunk(q, k, v, indices)
    for start in range(0, q_len, step):
        sl = slice(start, start + step)
        k_sel, v_sel, valid, _ = _gather(k, v, indices[:, sl])
        _, probs, lse_c = _probs(q[:, sl], k_sel, valid, scale)
        o = torch.einsum("bthgs,btshd->bthgd", probs, v_sel.float())
        out[:, sl] = o.flatten(2, 3).to(q.dtype)
        lse[:, sl] = lse_c.flatten(2, 3)
    return out, lse


def backward(q, k, v, indices, scale, out, lse, grad_out):
    """(dq, dk, dv) in the input dtypes; fp32 accumulation."""
    batch, q_len, heads, _ = q.shape
    hkv = k.shape[2]
    group = heads // hkv
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    rows = torch.arange(batch, device=q.device)[:, None, None]
    step = _chunk(q, k, v, indices)
    for start in range(0, q_len, step):
        sl = slice(start, start + step)
        tc = q[:, sl].shape[1]
        k_sel, v_sel, valid, safe = _gather(k, v, indices[:, sl])
        lse_c = lse[:, sl].view(batch, tc, hkv, group)
        qg, probs, _ = _probs(q[:, sl], k_sel, valid, scale, lse_c)
        do = grad_out[:, sl].float().view(batch, tc, hkv, group, -1)
        delta = (do * out[:, sl].float().view_as(do)).sum(-1)
        dp = torch.einsum("bthgd,btshd->bthgs", do, v_sel.float())
        ds = probs * (dp - delta[..., None])
        dq[:, sl] = (torch.einsum("bthgs,btshd->bthgd", ds, k_sel.float()) * scale).flatten(2, 3).to(q.dtype)
        dk.index_put_((rows, safe), torch.einsum("bthgs,bthgd->btshd", ds, qg) * scale, accumulate=True)
        dv.index_put_((rows, safe), torch.einsum("bthgs,bthgd->btshd", probs, do), accumulate=True)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
