"""The experts' weighted combine: the same output and gradients as autograd's fp32 `index_add(rows.float() * w)`,
and it keeps the rows in their own dtype for the backward, not an fp32 [tokens·k, hidden] copy (bf16 on GPUs: the
copy was twice the rows' size, per MoE layer, until the backward)."""

import torch

from moetune.workers.experts.module import _WeightedCombine


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    tokens, top_k, hidden = 6, 2, 8
    rows = torch.randn(tokens * top_k, hidden, generator=g).to(dtype).requires_grad_()
    weights = torch.rand(tokens * top_k, 1, generator=g).requires_grad_()
    token_of = torch.randperm(tokens * top_k, generator=g) // top_k
    return rows, weights, token_of, tokens


def test_equals_autograd_fp32_combine():
    rows, weights, token_of, tokens = _inputs(torch.float32)
    got = _WeightedCombine.apply(rows, weights, token_of, tokens)
    want = torch.zeros(tokens, rows.shape[1]).index_add(0, token_of, rows.float() * weights)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    upstream = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, (rows, weights), upstream)
    want_grads = torch.autograd.grad(want, (rows, weights), upstream)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_saves_the_rows_in_their_own_dtype():
    rows, weights, token_of, tokens = _inputs(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _WeightedCombine.apply(rows, weights, token_of, tokens)
    big = [(t.dtype, tuple(t.shape)) for t in saved if t.numel() >= rows.numel()]
    assert big == [(torch.bfloat16, tuple(rows.shape))], big
