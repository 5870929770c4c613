"""Sparse attention in plain PyTorch, shaped for CPUs: per block of queries, gather the union of their selected
keys once and run PyTorch's fused CPU attention (flash kernel, LSE returned) against it under the selection mask.

A per-query gather is bandwidth-bound on a CPU (every query copies its K rows); the union of a block's selections
is shared by all of its queries and query heads, so the work becomes fused GEMMs over at most the causal prefix of
the block. With the locality real indexers show the union is close to K; with independent random selections it is
at worst the prefix, which still skips the acausal half a dense mask pays for. Exact either way: keys outside a
query's own selection are masked. The backward reuses the saved LSE and adds dK/dV into the union rows.

Every tensor is packed once per call into the kernel's layout (kv head, query x group, padded head dim), so each
block costs few PyTorch ops: on a busy machine each parallel op pays a thread-barrier latency of its own.
Layouts: q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv], indices [B,T,K] with -1 = no key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_Q = 128
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _pack(x, hkv, width):
    """[T, H, D] -> [Hkv, T*G, width] contiguous, head dims zero-padded to a common width (the flash kernel wants
    equal head sizes for q, k and v; zero columns change no score and add zero output columns)."""
    seq, heads, dim = x.shape
    x = x.reshape(seq, hkv, heads // hkv, dim).permute(1, 0, 2, 3).reshape(hkv, seq * (heads // hkv), dim)
    return F.pad(x, (0, width - dim)).contiguous()


def _unpack(x, heads, dim):
    """[Hkv, T*G, width] -> [T, H, dim]."""
    hkv, rows, _ = x.shape
    group = heads // hkv
    return x[..., :dim].reshape(hkv, rows // group, group, dim).permute(1, 0, 2, 3).reshape(rows // group, heads, dim)


def _blocks(indices_b, kv_len, group, dtype):
    """Per block of BLOCK_Q queries: (packed rows, union of the selected key ids [U], additive mask [1,1,tq*G,U]).
    The unions of all blocks come from one scatter into a [blocks, S] hit table."""
    n_q = indices_b.shape[0]
    n_blocks = -(-n_q // BLOCK_Q)
    idx = F.pad(indices_b.long(), (0, 0, 0, n_blocks * BLOCK_Q - n_q), value=-1).view(n_blocks, -1)
    slots = torch.where(idx >= 0, idx, kv_len)  # invalid -> a spare slot past the keys
    hit = torch.zeros(n_blocks, kv_len + 1, dtype=torch.bool, device=idx.device).scatter_(1, slots, True)
    hit[:, kv_len] = False
    sizes = hit.sum(1)
    column = torch.cumsum(hit, 1) - 1  # key id -> its column in the block's union
    column[:, kv_len] = sizes  # the spare column, dropped below
    columns = column.gather(1, slots).view(n_blocks, BLOCK_Q, -1)
    unions = hit.nonzero()[:, 1].split(sizes.tolist())
    for blk, union in enumerate(unions):
        rows = min(BLOCK_Q, n_q - blk * BLOCK_Q)
        bias = torch.full((rows, union.numel() + 1), float("-inf"), dtype=dtype, device=idx.device)
        bias = bias.scatter_(1, columns[blk, :rows], 0.0)[:, :-1]
        bias = bias.repeat_interleave(group, dim=0) if group > 1 else bias
        yield slice(blk * BLOCK_Q * group, (blk * BLOCK_Q + rows) * group), union, bias[None, None].contiguous()


def forward(q, k, v, indices, scale):
    """Output [B,T,H,Dv] in q's dtype and the LSE [B,T,H] in fp32 (-inf for a query without keys)."""
    heads, hkv, dv = q.shape[2], k.shape[2], v.shape[3]
    width, group = max(k.shape[3], dv), heads // hkv
    out = q.new_empty(*q.shape[:3], dv)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        q_p, k_p, v_p = _pack(q[b], hkv, width), _pack(k[b], hkv, width), _pack(v[b], hkv, width)
        out_p = torch.empty_like(q_p)
        lse_p = torch.empty(q_p.shape[:2], dtype=torch.float32, device=q.device)
        for rows, union, bias in _blocks(indices[b], k.shape[1], group, q.dtype):
            o, l = _flash(q_p[None, :, rows], k_p.index_select(1, union)[None], v_p.index_select(1, union)[None],
                          attn_mask=bias, scale=scale)
            out_p[:, rows], lse_p[:, rows] = o[0], l[0]
        out[b], lse[b] = _unpack(out_p, heads, dv), _unpack(lse_p[..., None], heads, 1)[..., 0]
    empty = (indices < 0).all(-1)
    return out.masked_fill_(empty[..., None, None], 0.0), lse.masked_fill_(empty[..., None], float("-inf"))


def backward(q, k, v, indices, scale, out, lse, grad_out):
    """(dq, dk, dv) in the input dtypes; dK/dV accumulate in fp32."""
    heads, hkv, dk_dim, dv_dim = q.shape[2], k.shape[2], k.shape[3], v.shape[3]
    width, group = max(dk_dim, dv_dim), heads // hkv
    empty = (indices < 0).all(-1)
    grad_out = grad_out.masked_fill(empty[..., None, None], 0.0)  # a query without keys passes nothing back
    lse = lse.masked_fill(empty[..., None], 0.0)  # and must not turn the kernel's exp(s - lse) into NaN
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b in range(q.shape[0]):
        q_p, k_p, v_p = _pack(q[b], hkv, width), _pack(k[b], hkv, width), _pack(v[b], hkv, width)
        o_p, do_p = _pack(out[b], hkv, width), _pack(grad_out[b], hkv, width)
        lse_p = _pack(lse[b, ..., None], hkv, 1)[..., 0]
        dq_p = torch.empty_like(q_p)
        dk_p = torch.zeros(k_p.shape, dtype=torch.float32, device=k.device)
        dv_p = torch.zeros(v_p.shape, dtype=torch.float32, device=v.device)
        for rows, union, bias in _blocks(indices[b], k.shape[1], group, q.dtype):
            g_q, g_k, g_v = _flash_backward(do_p[None, :, rows], q_p[None, :, rows], k_p.index_select(1, union)[None],
                                            v_p.index_select(1, union)[None], o_p[None, :, rows], lse_p[None, :, rows],
                                            0.0, False, attn_mask=bias, scale=scale)
            dq_p[:, rows] = g_q[0]
            dk_p.index_add_(1, union, g_k[0].float())
            dv_p.index_add_(1, union, g_v[0].float())
        dq[b] = _unpack(dq_p, heads, dk_dim)
        dk[b], dv[b] = _unpack(dk_p, hkv, dk_dim), _unpack(dv_p, hkv, dv_dim)
    return dq, dk, dv
