"""Sparse attention in plain PyTorch, shaped for CPUs: per block of queries, gather the union of their selected
keys once and run PyTorch's fused CPU attention (flash kernel, LSE returned) against it under the selection mask.

A per-query gather is bandwidth-bound on a CPU (every query copies its K rows); the union of a block's selections
is shared by all of its queries and query heads, so the work becomes fused GEMMs over at most the causal prefix of
the block. With the locality real indexers show the union is close to K; with independent random selections it is
at worst the prefix, which still skips the acausal half a dense mask pays for. Exact either way: keys outside a
query's own selection are masked. The backward reuses the saved LSE and adds dK/dV into the union rows.
Layouts: q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv] with -1 = no key in indices [B,T,K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_Q = 128
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _blocks(q, indices, kv_len):
    """Per block of queries: (batch, query slice, union key ids [U], selection mask [tq, U])."""
    for b in range(q.shape[0]):
        for start in range(0, q.shape[1], BLOCK_Q):
            sl = slice(start, start + BLOCK_Q)
            idx = indices[b, sl].long()
            valid = idx >= 0
            slots = torch.where(valid, idx, kv_len)  # invalid -> a spare slot past the keys
            hit = torch.zeros(kv_len + 1, dtype=torch.bool, device=q.device)
            hit[slots] = True
            hit[kv_len] = False
            union = hit.nonzero().squeeze(1)
            position = torch.cumsum(hit, 0) - 1  # key id -> its column in the union
            selected = torch.zeros(idx.shape[0], union.numel() + 1, dtype=torch.bool, device=q.device)
            selected.scatter_(1, torch.where(valid, position[slots], union.numel()), True)
            yield b, sl, union, selected[:, :-1]


def _pack(x, hkv, width):
    """[tq, H, D] -> [1, Hkv, tq*G, width] contiguous (head dims zero-padded to the common width)."""
    tq, heads, dim = x.shape
    x = x.reshape(tq, hkv, heads // hkv, dim).permute(1, 0, 2, 3).reshape(1, hkv, tq * (heads // hkv), dim)
    return F.pad(x, (0, width - dim)).contiguous()


def _unpack(x, heads, dim):
    """[1, Hkv, tq*G, width] -> [tq, H, dim]."""
    _, hkv, rows, _ = x.shape
    return x[..., :dim].reshape(hkv, rows // (heads // hkv), heads // hkv, dim).permute(1, 0, 2, 3).reshape(-1, heads,
                                                                                                           dim)


def _operands(q, k, v, b, sl, union, selected):
    hkv, width = k.shape[2], max(k.shape[3], v.shape[3])
    group = q.shape[2] // hkv
    bias = torch.zeros(selected.shape, dtype=q.dtype, device=q.device).masked_fill_(~selected, float("-inf"))
    bias = bias.repeat_interleave(group, dim=0)[None, None].contiguous()
    k_u = F.pad(k[b, union].transpose(0, 1), (0, width - k.shape[3]))[None].contiguous()
    v_u = F.pad(v[b, union].transpose(0, 1), (0, width - v.shape[3]))[None].contiguous()
    return _pack(q[b, sl], hkv, width), k_u, v_u, bias, width


def forward(q, k, v, indices, scale):
    """Output [B,T,H,Dv] in q's dtype and the LSE [B,T,H] in fp32 (-inf for a query without keys)."""
    heads, hkv, dv = q.shape[2], k.shape[2], v.shape[3]
    out = q.new_empty(*q.shape[:3], dv)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b, sl, union, selected in _blocks(q, indices, k.shape[1]):
        q_p, k_u, v_u, bias, _ = _operands(q, k, v, b, sl, union, selected)
        out_p, lse_p = _flash(q_p, k_u, v_u, attn_mask=bias, scale=scale)
        empty = ~selected.any(1)
        out[b, sl] = _unpack(out_p, heads, dv).masked_fill(empty[:, None, None], 0.0)
        lse[b, sl] = _unpack(lse_p[..., None], heads, 1)[..., 0].masked_fill(empty[:, None], float("-inf"))
    return out, lse


def backward(q, k, v, indices, scale, out, lse, grad_out):
    """(dq, dk, dv) in the input dtypes."""
    heads, hkv, dk_dim, dv_dim = q.shape[2], k.shape[2], k.shape[3], v.shape[3]
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for b, sl, union, selected in _blocks(q, indices, k.shape[1]):
        q_p, k_u, v_u, bias, width = _operands(q, k, v, b, sl, union, selected)
        empty = ~selected.any(1)[:, None]
        grad_p = _pack(grad_out[b, sl].masked_fill(empty[..., None], 0.0), hkv, width)  # no keys: nothing flows
        lse_p = _pack(lse[b, sl].masked_fill(empty, 0.0)[..., None], hkv, 1)[..., 0]
        dq_p, dk_p, dv_p = _flash_backward(grad_p, q_p, k_u, v_u, _pack(out[b, sl], hkv, width), lse_p, 0.0, False,
                                           attn_mask=bias, scale=scale)
        dq[b, sl] = _unpack(dq_p, heads, dk_dim).to(q.dtype)
        dk[b].index_add_(0, union, dk_p[0, :, :, :dk_dim].transpose(0, 1).float())
        dv[b].index_add_(0, union, dv_p[0, :, :, :dv_dim].transpose(0, 1).float())
    return dq, dk.to(k.dtype), dv.to(v.dtype)
