"""kernels.moe's grouped LoRA GEMM against the per-expert fp32 reference: output and the gradients of x, A, B."""

from __future__ import annotations

import torch

from moetune.kernels.moe import moe_lora_grouped
from moetune.kernels.moe.reference import moe_lora_reference
from moetune.kernels.testing import rmse_ratio

SCALE = 2.0


def check_grouped(backend, x, counts, w, w_dense, a, b, grad, tol, empty_experts) -> None:
    """`w` as moe_lora_grouped takes it (dense [E, in, out] or a QuantizedWeight); `w_dense` its fp32 [E, in, out]
    values; the experts in `empty_experts` have no rows, so their LoRA gets no gradient."""
    expected = moe_lora_reference(x.float(), counts, w_dense, a.float(), b.float(), SCALE)
    exp_grads = torch.autograd.grad(expected, (x, a, b), grad.float())
    out = moe_lora_grouped(x, counts, w, a, b, SCALE, backend=backend)
    grads = torch.autograd.grad(out, (x, a, b), grad)
    assert out.dtype == x.dtype and out.shape == expected.shape
    for name, got, want in zip(("y", "dx", "da", "db"), (out, *grads), (expected, *exp_grads)):
        assert rmse_ratio(got, want) <= tol, (name, rmse_ratio(got, want))
    for e in empty_experts:
        assert grads[1][e].abs().max() == 0 and grads[2][e].abs().max() == 0
