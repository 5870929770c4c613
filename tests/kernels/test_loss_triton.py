"""kernels.loss: the chunked linear + cross-entropy equals the plain loss and its gradient, never allocates a
[tokens, vocab] tensor; Liger's fused kernel (the CUDA path) agrees with it, run through the Triton interpreter in a
child process (tests.support.triton_child)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.loss import linear_cross_entropy_sum
from moetune.kernels.loss.chunked import chunked_linear_cross_entropy_sum
from moetune.kernels.loss.dispatch import _liger_sum, logits_chunk_rows
from tests.support.allocations import Allocations
from tests.support.triton_child import (  # noqa: F401 (test_interpreter_run: collected here)
    backend_device,
    on_triton,
    test_interpreter_run,
    to_device,
)


def _inputs(tokens=75, hidden=24, vocab=300, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden**0.5
    return h, w, torch.randint(0, vocab, (tokens,), generator=g)


def _loss_and_grad(fn, h, w, y):
    h.grad = None
    loss = fn(h, w, y)
    (loss * 0.5).backward()  # a scaled loss, as the step scales it
    return loss.detach(), h.grad.clone()


def _plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, reduction="sum")


def test_chunked_equals_the_plain_loss_and_gradient():
    h, w, y = _inputs()
    want_loss, want_grad = _loss_and_grad(_plain, h, w, y)
    for chunk in (16, 75, 1000):  # several chunks with a partial last one, exactly one, one larger than the input
        loss, grad = _loss_and_grad(lambda *a: chunked_linear_cross_entropy_sum(*a, chunk_tokens=chunk), h, w, y)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-6)


def test_a_micro_batch_without_loss_tokens_gives_zero():
    h, w, y = _inputs(tokens=0)
    loss, grad = _loss_and_grad(linear_cross_entropy_sum, h, w, y)
    assert loss.item() == 0.0 and grad.shape == (0, h.shape[1])


def test_no_tensor_of_tokens_times_vocab():
    h, w, y = _inputs(tokens=512, vocab=1000)
    with Allocations() as seen:
        chunked_linear_cross_entropy_sum(h, w, y, chunk_tokens=64).backward()
    assert seen.largest <= 64 * 1000  # one chunk's logits; the plain loss allocates 512 × 1000
    with Allocations() as plain:
        _plain(h, w, y).backward()
    assert plain.largest >= 512 * 1000


def test_the_planned_logits_chunk_is_what_each_path_holds():
    """logits_chunk_rows, which the planner counts: the CPU path's largest tensor is its chunk's fp32 logits (Liger's,
    the CUDA path's, under the interpreter below); on CUDA the chunk grows with the tokens, as the review of K3's
    plan measured: 2.5 GiB of bf16 logits at 128K tokens, 20 GiB at 1M."""
    h, w, y = _inputs(tokens=5000, vocab=1000)
    with Allocations() as seen:
        linear_cross_entropy_sum(h, w, y).backward()
    assert seen.largest == logits_chunk_rows(5000, 1000, 24, on_cuda=False) * 1000 < 5000 * 1000
    k3_vocab, k3_hidden = 163840, 7168
    assert [logits_chunk_rows(t, k3_vocab, k3_hidden, on_cuda=True) * k3_vocab * 2 / 2**30
            for t in (131072, 1048576)] == [2.5, 20.0]


@on_triton
def test_liger_holds_the_logits_chunk_the_planner_counts():
    h, w, y = to_device(backend_device(), *_inputs())
    with Allocations() as seen:
        _liger_sum(h, w, y)
    assert seen.largest == logits_chunk_rows(75, 300, 24, on_cuda=True) * 300  # 8 rows of 300 (of 75 tokens)


@on_triton
def test_liger_triton_kernel_agrees():
    h, w, y = to_device(backend_device(), *_inputs())
    want_loss, want_grad = _loss_and_grad(chunked_linear_cross_entropy_sum, h, w, y)
    loss, grad = _loss_and_grad(_liger_sum, h, w, y)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-5)
