"""Causal attention of queries that are the last Tq of Tk keys (a context-parallel rank's slice over its row's
gathered keys), each query attending to the keys up to itself: the causal mask aligned to the bottom right.

Flash kernels on CUDA take that alignment without a mask (`torch.nn.attention.bias.causal_lower_right`). torch's
CPU flash kernel aligns causal masks to the top left only, so `causal_lower_right` builds a [Tq, Tk] mask there,
which the kernel keeps for the backward: 64 MiB a layer for 2K queries over 8K keys in fp32, growing with the row's
square. Here, on CPU, the keys before the queries (every query sees them all) and the square block of the queries'
own keys (causal, top left) run as two unmasked kernel calls whose outputs merge by their log-sum-exps; the
backward runs each block's kernel backward with the merged output and log-sum-exp, whose softmax is the one over
all the keys, so the blocks' gradients are those of the whole attention (ring attention's identity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def trailing_causal_attention(query, key, value, scale: float | None = None) -> torch.Tensor:
    """query (B, H, Tq, D), key and value (B, H, Tk, D), Tq ≤ Tk: (B, H, Tq, D)."""
    if query.device.type != "cpu":
        mask = causal_lower_right(query.shape[2], key.shape[2])
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return _TrailingCausal.apply(query, key, value, scale)


def _blocks(queries: int, keys: int) -> list[tuple[slice, bool]]:
    """The key blocks and whether each is causal: the keys before the queries, then the queries' own."""
    before = keys - queries
    own = [(slice(before, keys), True)]
    return [(slice(0, before), False), *own] if before else own


class _TrailingCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale):
        out = lse = None
        for keys, causal in _blocks(query.shape[2], key.shape[2]):
            part, part_lse = _flash_cpu(query, key[:, :, keys], value[:, :, keys], 0.0, causal, scale=scale)
            if out is None:
                out, lse = part.float(), part_lse
                continue
            merged = torch.logaddexp(lse, part_lse)
            out = out * (lse - merged).exp().unsqueeze(-1) + part.float() * (part_lse - merged).exp().unsqueeze(-1)
            lse = merged
        out = out.to(query.dtype)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        d_query = torch.zeros_like(query, dtype=torch.float32)
        d_key, d_value = torch.empty_like(key), torch.empty_like(value)
        for keys, causal in _blocks(query.shape[2], key.shape[2]):
            dq, d_key[:, :, keys], d_value[:, :, keys] = _flash_cpu_backward(
                grad_out, query, key[:, :, keys].contiguous(), value[:, :, keys].contiguous(), out, lse, 0.0,
                causal, scale=ctx.scale)
            d_query += dq
        return d_query.to(query.dtype), d_key, d_value, None
