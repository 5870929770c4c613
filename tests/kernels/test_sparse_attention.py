"""Sparse attention against the dense-mask oracle: the PyTorch path and the Triton kernels (through the interpreter
on CPU), forward and every gradient, plus the indexer's causal top-k and an sm_90 compile of both kernels."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.sparse_attention import select_topk, sparse_attention
from moetune.kernels.sparse_attention.reference import (
    indexer_scores_reference,
    sparse_attention_reference,
    topk_mask,
)
from moetune.kernels.testing import rmse_ratio
from tests.support.triton_child import (  # noqa: F401 (test_interpreter_run: collected here)
    backend_device,
    on_triton,
    test_interpreter_run,
    to_device,
)


def _inputs(batch=2, q_len=37, heads=4, kv_heads=2, dk=24, dv=20, topk=16, dtype=torch.float32, seed=0):
    """Shapes that are not multiples of any block size; topk > the causal prefix for the first queries."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, heads, dk, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(batch, q_len, kv_heads, dk, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(batch, q_len, kv_heads, dv, generator=gen).to(dtype).requires_grad_()
    q_idx = torch.randn(batch, q_len, 3, 8, generator=gen)
    k_idx = torch.randn(batch, q_len, 8, generator=gen)
    w = torch.randn(batch, q_len, 3, generator=gen)
    indices = select_topk(q_idx, k_idx, w, topk)
    indices[1, 5] = -1  # a query that selected nothing at all
    grad = torch.randn(batch, q_len, heads, dv, generator=gen).to(dtype)
    return q, k, v, indices, grad


def _check_against_oracle(backend, dtype, tol, q_len=37):
    q, k, v, indices, grad = to_device(backend_device(backend), *_inputs(q_len=q_len, dtype=dtype))
    gate = torch.randn(*q.shape[:3], v.shape[-1], dtype=dtype, device=q.device).requires_grad_()
    expected = sparse_attention_reference(q.float(), k.float(), v.float(), indices, 0.3, gate.float())
    exp_grads = torch.autograd.grad(expected, (q, k, v, gate), grad.float())
    out = sparse_attention(q, k, v, indices, 0.3, gate=gate, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v, gate), grad)
    assert out.dtype == dtype
    for name, got, want in zip(("out", "dq", "dk", "dv", "dgate"), (out, *grads), (expected, *exp_grads)):
        assert rmse_ratio(got, want) <= tol, (name, rmse_ratio(got, want))
    assert out[1, 5].abs().max() == 0 and grads[0][1, 5].abs().max() == 0  # no keys: zero output, zero dq


def test_indexer_selects_the_causal_topk_of_the_dense_scores():
    gen = torch.Generator().manual_seed(1)
    q_idx, k_idx, w = torch.randn(2, 29, 4, 16, generator=gen), torch.randn(2, 29, 16, generator=gen), \
        torch.randn(2, 29, 4, generator=gen)
    indices = select_topk(q_idx, k_idx, w, 8)
    scores = indexer_scores_reference(q_idx, k_idx, w)
    causal = torch.ones(29, 29, dtype=torch.bool).tril()
    for t in range(29):
        n_valid = min(8, t + 1)
        assert (indices[:, t, n_valid:] == -1).all()  # topk larger than the causal prefix
        chosen = indices[:, t, :n_valid].long()
        assert (chosen <= t).all() and (chosen >= 0).all()
        best = scores[:, t].masked_fill(~causal[t], float("-inf")).topk(n_valid, dim=-1).values
        torch.testing.assert_close(scores[:, t].gather(-1, chosen), best)


def test_indexer_chunks_queries_against_a_longer_cache():
    """Queries that continue a cache (T < S) see keys up to their own position S - T + t."""
    gen = torch.Generator().manual_seed(2)
    q_idx, k_idx, w = torch.randn(1, 5, 2, 8, generator=gen), torch.randn(1, 12, 8, generator=gen), \
        torch.randn(1, 5, 2, generator=gen)
    indices = select_topk(q_idx, k_idx, w, 12)
    assert [(row >= 0).sum().item() for row in indices[0]] == [8, 9, 10, 11, 12]


def test_indexer_chunks_fill_the_memory_budget_and_select_exactly(monkeypatch):
    """Chunks as large as the budget allows (not a fixed element cap: that left 2 rows at 128K keys), each the
    same selection as one query row at a time."""
    from moetune.kernels.sparse_attention import indexer

    gen = torch.Generator().manual_seed(3)
    q_idx, k_idx, w = torch.randn(1, 512, 8, 16, generator=gen), torch.randn(1, 512, 16, generator=gen), \
        torch.randn(1, 512, 8, generator=gen)
    row_bytes = 512 * (4 * 8 + indexer.ROW_OVERHEAD)  # [H, S] fp32 logits and the per-key overhead of one row
    monkeypatch.setattr(indexer, "CPU_BUDGET_BYTES", 170 * row_bytes + 1)
    spans, causal = [], indexer._causal(512, 512, "cpu")

    def visible(start, stop):
        spans.append((start, stop))
        return causal(start, stop)

    chunked = select_topk(q_idx, k_idx, w, 24, visible=visible)
    assert spans == [(0, 170), (170, 340), (340, 510), (510, 512)]
    torch.testing.assert_close(chunked, select_topk(q_idx, k_idx, w, 24, rows=1), rtol=0, atol=0)


def test_indexer_budget_is_a_share_of_the_free_device_memory(monkeypatch):
    """On CUDA: FREE_SHARE of the driver's free memory plus what torch's allocator holds unused."""
    from moetune.kernels.sparse_attention import indexer

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 140 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 30 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 10 * 2**30)
    assert indexer.memory_budget("cuda:0") == int(indexer.FREE_SHARE * 80 * 2**30)
    row_bytes = 131072 * (4 * 64 + indexer.ROW_OVERHEAD)  # 128K keys, 64 index heads
    assert indexer.chunk_rows(131072, row_bytes, "cuda:0") == int(indexer.FREE_SHARE * 80 * 2**30) // row_bytes
    assert indexer.chunk_rows(7, row_bytes, "cuda:0") == 7  # never more rows than queries
    assert indexer.chunk_rows(7, 2**40, "cpu") == 1  # at least one row, whatever the budget


def test_topk_mask_ignores_invalid_slots():
    mask = topk_mask(torch.tensor([[[0, -1, 2]]]), 4)
    assert mask.tolist() == [[[True, False, True, False]]]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.005), (torch.bfloat16, 0.01)])
def test_torch_path_matches_the_oracle(dtype, tol):
    _check_against_oracle("torch", dtype, tol)


def test_torch_path_over_several_query_blocks():
    from moetune.kernels.sparse_attention import torch_impl

    q_len = 2 * torch_impl.BLOCK_Q + 45  # two full blocks of queries and a partial one
    _check_against_oracle("torch", torch.float32, 0.005, q_len=q_len)


@on_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.005), (torch.float16, 0.005), (torch.bfloat16, 0.01)])
def test_triton_kernels_match_the_oracle(dtype, tol):
    _check_against_oracle("triton", dtype, tol)


@on_triton
def test_triton_kernels_over_a_shared_latent(dtype=torch.bfloat16, tol=0.01):
    """MLA absorbed: one kv head whose first columns are also the values (v = kv[..., :20]: the key's main part
    and 4 of its tail, 24 = 16 + 8), 72 query heads (two head blocks), 70 keys of which each query selects 24.
    The latent's gradient (keys and values in one) matches the oracle's."""
    device = backend_device("triton")
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 70, 72, 24, generator=gen).to(dtype).to(device).requires_grad_()
    kv = torch.randn(1, 70, 1, 24, generator=gen).to(dtype).to(device).requires_grad_()
    indices = select_topk(torch.randn(1, 70, 2, 8, generator=gen), torch.randn(1, 70, 8, generator=gen),
                          torch.randn(1, 70, 2, generator=gen), 24).to(device)
    grad = torch.randn(1, 70, 72, 20, generator=gen).to(dtype).to(device)
    expected = sparse_attention_reference(q.float(), kv.float(), kv.float()[..., :20], indices, 0.2)
    want = torch.autograd.grad(expected, (q, kv), grad.float())
    out = sparse_attention(q, kv, kv[..., :20], indices, 0.2, backend="triton")
    got = torch.autograd.grad(out, (q, kv), grad)
    for name, a, b in zip(("out", "dq", "dkv"), (out, *got), (expected, *want)):
        assert rmse_ratio(a, b) <= tol, (name, rmse_ratio(a, b))


def test_inverted_selection_lists_each_key_blocks_queries():
    from moetune.kernels.sparse_attention.triton_impl import invert_selection

    gen = torch.Generator().manual_seed(6)
    indices = select_topk(torch.randn(2, 41, 2, 8, generator=gen), torch.randn(2, 41, 8, generator=gen),
                          torch.randn(2, 41, 2, generator=gen), 12)
    indices[1, 7] = -1
    offsets, pair_q, pair_bits = invert_selection(indices, 41, 16)
    blocks = 3
    for b in range(2):
        for blk in range(blocks):
            lo, hi = offsets[b * blocks + blk].item(), offsets[b * blocks + blk + 1].item()
            listed = {(pair_q[p].item(), pair_bits[p].item()) for p in range(lo, hi)}
            want = set()
            for t in range(41):
                keys = [s for s in indices[b, t].tolist() if s >= 0 and s // 16 == blk]
                if keys:
                    want.add((t, sum(1 << (s % 16) for s in keys)))
            assert listed == want, (b, blk)
            assert pair_q[lo:hi].tolist() == sorted(pair_q[lo:hi].tolist())


def test_default_backend_on_cpu_is_the_torch_path():
    q, k, v, indices, _ = _inputs()
    out = sparse_attention(q, k, v, indices, 0.3)
    torch.testing.assert_close(out, sparse_attention(q, k, v, indices, 0.3, backend="torch"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, k, v, indices, 0.3, backend="cuda-magic")
    with pytest.raises(ValueError, match="at least 16 dims"):  # before any launch
        sparse_attention(q[..., :8], k[..., :8], v, indices, 0.3, backend="triton")


def _latent_inputs(q_len=40, heads=20, width=24, topk=12, seed=7):
    """MLA absorbed in small: queries, one kv head of 24 = 16 + 8 columns (its first ones are the values), a
    selection of a fraction of the keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, q_len, heads, width, generator=gen).requires_grad_()
    kv = torch.randn(1, q_len, 1, width, generator=gen).requires_grad_()
    indices = select_topk(torch.randn(1, q_len, 2, 8, generator=gen), torch.randn(1, q_len, 8, generator=gen),
                          torch.randn(1, q_len, 2, generator=gen), topk)
    return q, kv, indices, torch.randn(1, q_len, heads, 20, generator=gen)


@on_triton
@pytest.mark.parametrize("layout", ["grouped", "latent"])
def test_triton_dkv_orders_match_the_oracle(layout):
    """Both dK/dV passes (key-major over the inverted selection, query-major with fp32 atomics) in fp32 against the
    oracle's gradients: over grouped heads (a query that selected nothing included) and over a shared latent whose
    values reach into the key's tail (20 of 24 columns: dV goes into dK). Key-major repeats bit for bit."""
    from moetune.kernels.sparse_attention import triton_impl

    device = backend_device("triton")
    if layout == "grouped":
        q, k, v, indices, grad = to_device(device, *_inputs(q_len=20, topk=8))
        leaves = (q, k, v)
    else:
        q, k, indices, grad = to_device(device, *_latent_inputs())
        v, leaves = k[..., :20], (q, k)
    want = torch.autograd.grad(sparse_attention_reference(q, k, v, indices, 0.3), leaves, grad)
    with torch.no_grad():
        out, lse = triton_impl.forward(q, k, v, indices, 0.3)
        runs = {order: triton_impl.backward(q, k, v, indices, 0.3, out, lse, grad, order=order)
                for order in triton_impl.DKV_ORDERS}
        again = triton_impl.backward(q, k, v, indices, 0.3, out, lse, grad, order="key_major")
    for order, (dq, dk, dv) in runs.items():
        assert (dv is None) == (layout == "latent")  # shared values: their gradient is in the keys'
        for name, a, b in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
            assert rmse_ratio(a, b) <= 1e-5, (order, name, rmse_ratio(a, b))
    assert all(a is None or torch.equal(a, b) for a, b in zip(runs["key_major"], again))
