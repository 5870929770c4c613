"""MLA's dense attention at the key width (workers/families/mla.py `sdpa_at_key_width`): with a key wider than the
value, as in every released MLA config, it returns transformers' SDPA attention and its gradients, and keeps no
[B, H, T, T] attention matrix (PyTorch's CPU SDPA does, on its math path, for unequal widths)."""

import types

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from moetune.workers.families.mla import sdpa_at_key_width
from tests.support.allocations import Allocations

MODULE = types.SimpleNamespace(is_causal=True)  # what transformers' SDPA reads of the attention module


def _qkv(length: int):
    g = torch.Generator().manual_seed(0)
    heads, nope, rope, v = 2, 16, 8, 16  # the released ratio 128 : 64 : 128
    return [torch.randn(1, heads, length, d, generator=g, requires_grad=True) for d in (nope + rope, nope + rope, v)]


def _out_and_grads(attention, qkv):
    out, _ = attention(MODULE, *qkv, None, scaling=0.2)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad for t in qkv]
    for t in qkv:
        t.grad = None
    return out.detach(), grads


def test_it_is_transformers_sdpa():
    qkv = _qkv(50)
    want, want_grads = _out_and_grads(sdpa_attention_forward, qkv)
    out, grads = _out_and_grads(sdpa_at_key_width, qkv)
    assert out.shape == want.shape == (1, 50, 2, 16)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for grad, expected in zip(grads, want_grads):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


def test_it_keeps_no_attention_matrix():
    length = 4096
    with Allocations() as seen:
        _out_and_grads(sdpa_at_key_width, _qkv(length))
    assert seen.largest < length * length // 32, seen.largest
