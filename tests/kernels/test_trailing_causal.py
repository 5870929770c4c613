"""kernels.attention.trailing_causal on CPU: queries that are the last Tq of Tk keys, each over the keys up to
itself, equal SDPA with the bottom-right causal mask built (outputs and every gradient, fp32 and bf16), with no
[Tq, Tk] tensor kept for the backward."""

import pytest
import torch
import torch.nn.functional as F

from moetune.kernels.attention.trailing_causal import trailing_causal_attention
from moetune.workers.planner.saved import SavedBytes


def _masked(query, key, value, scale):
    tq, tk = query.shape[2], key.shape[2]
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(diagonal=tk - tq)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("queries, keys", [(7, 7), (5, 19), (64, 256)])
def test_equals_attention_with_the_bottom_right_causal_mask(dtype, tolerance, queries, keys):
    torch.manual_seed(0)
    leaves = [torch.randn(2, 3, n, 16, dtype=dtype) for n in (queries, keys, keys)]
    probe = torch.randn(2, 3, queries, 16, dtype=dtype)
    results = []
    for attend in (trailing_causal_attention, _masked):
        inputs = [x.clone().requires_grad_() for x in leaves]
        out = attend(*inputs, scale=0.3)
        (out.float() * probe.float()).sum().backward()
        results.append([out, *(x.grad for x in inputs)])
    for got, want in zip(*results):
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max()


def test_no_mask_is_kept_for_the_backward():
    """What autograd keeps grows with the row, not with its square (the built mask's 4 × 2,048 × 8,192 bytes would
    be 64 MiB here)."""
    query, key, value = (torch.randn(1, 1, n, 8, requires_grad=True) for n in (2048, 8192, 8192))
    counter = SavedBytes(torch.nn.Linear(1, 1))
    with counter.counting():
        trailing_causal_attention(query, key, value)
    assert counter.total < 2 * (query.nbytes + key.nbytes + value.nbytes)
