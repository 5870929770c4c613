"""Quantized frozen experts in kernels.moe: the Triton grouped GEMM dequantizing FP8-block, INT4 pack-quantized and
MXFP4 tiles in the kernel (through the interpreter on CPU) and the torch backend's per-expert path, both against the
per-expert loop over the dequantized weights: forward, dX, dA and dB, experts with no tokens, an expert with more
than one row tile, widths that are not multiples of the blocks; plus an sm_90 compile of the quantized kernels."""

from __future__ import annotations

import functools

import pytest
import torch

from moetune.kernels.moe import moe_lora_grouped, moe_lora_mlp
from moetune.kernels.moe.reference import moe_lora_reference
from moetune.kernels.moe.linear import triton_quantized_linear
from moetune.kernels.quant import quantize_fp8_block, quantize_int4, quantize_mxfp4
from moetune.kernels.testing import rmse_ratio
from tests.support.moe_reference import check_grouped
from tests.support.triton_child import (  # noqa: F401 (test_interpreter_run: collected here)
    backend_device,
    interpreting,
    on_triton,
    test_interpreter_run,
    to_device,
)

# format -> (quantizer, in, out): FP8 blocks leave partial edge blocks in both dims (40 = 16 + 16 + 8, 72 = 64 + 8;
# and one partial 128 x 128 block); INT4 groups and MXFP4 blocks need in % 32 == 0, out = 40 is still ragged
FORMATS = {
    "fp8-16x32": (functools.partial(quantize_fp8_block, block=(16, 32)), 72, 40),
    "fp8-128": (quantize_fp8_block, 72, 40),
    "int4": (functools.partial(quantize_int4, group=32), 96, 40),
    "mxfp4": (quantize_mxfp4, 96, 40),
}
COUNTS = (5, 0, 70)  # an expert without tokens, one with more than BLOCK_M (64) rows
# the interpreter's fp32 dot is exact, a GPU's is tf32
TOLERANCE = {torch.float32: 1e-5 if interpreting() else 5e-3, torch.bfloat16: 0.01}


def _inputs(fmt, dtype, rank=4, seed=0):
    quantize, d_in, d_out = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS)
    n_rows, n_experts = int(counts.sum()), counts.numel()
    q = quantize(torch.randn(n_experts, d_out, d_in, generator=gen) * d_in ** -0.5)
    x = torch.randn(n_rows, d_in, generator=gen).to(dtype).requires_grad_()
    a = (torch.randn(n_experts, d_in, rank, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(n_experts, rank, d_out, generator=gen) * 0.3).to(dtype).requires_grad_()
    grad = torch.randn(n_rows, d_out, generator=gen).to(dtype)
    return q, x, counts, a, b, grad


def _check(backend, fmt, dtype, tol):
    q, x, counts, a, b, grad = to_device(backend_device(backend), *_inputs(fmt, dtype))
    w = q.dequantize(dtype=dtype).float().transpose(1, 2)  # the weight as the compute dtype sees it, [E, in, out]
    check_grouped(backend, x, counts, q, w, a, b, grad, tol, empty_experts=[1])  # expert 1: no tokens


@on_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_dequantizes_in_the_kernel(fmt, dtype):
    _check("triton", fmt, dtype, TOLERANCE[dtype])


@on_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_quantized_linear_is_the_kernel_with_one_expert(fmt, dtype):
    """QuantizedLinear's CUDA path (kernels/moe/linear.py): the grouped kernel over one expert, forward and
    dX against x Wᵀ with W dequantized to the compute dtype, leading dims kept."""
    quantize, d_in, d_out = FORMATS[fmt]
    gen = torch.Generator().manual_seed(7)
    q = quantize(torch.randn(d_out, d_in, generator=gen) * d_in ** -0.5)
    x = torch.randn(2, 35, d_in, generator=gen).to(dtype).requires_grad_()
    grad = torch.randn(2, 35, d_out, generator=gen).to(dtype)
    q, x, grad = to_device(backend_device(), q, x, grad)
    w = q.dequantize(dtype=dtype).float()
    out = triton_quantized_linear(x, q)
    (dx,) = torch.autograd.grad(out, x, grad)
    assert out.dtype == dx.dtype == dtype and out.shape == (2, 35, d_out)
    assert rmse_ratio(out, x.float() @ w.T) <= TOLERANCE[dtype]
    assert rmse_ratio(dx, grad.float() @ w) <= TOLERANCE[dtype]


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_backend_runs_expert_by_expert(fmt):
    _check("torch", fmt, torch.float32, 1e-6)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
def test_asymmetric_int4_runs_on_the_torch_path(backend):
    """The kernel reads symmetric INT4 only: a zero point falls back to the per-expert path, with the same result."""
    _, x, counts, a, b, grad = to_device(backend_device(backend), *_inputs("int4", torch.float32))
    q = quantize_int4(torch.randn(3, 40, 96, device=x.device), symmetric=False)
    expected = moe_lora_reference(x, counts, q.dequantize().transpose(1, 2), a, b, 2.0)
    torch.testing.assert_close(moe_lora_grouped(x, counts, q, a, b, 2.0, backend=backend), expected)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
@pytest.mark.parametrize("fmt", ["fp8-16x32", "int4", "mxfp4"])
def test_quantized_expert_mlp_is_the_expert_parallel_compute(fmt, backend):
    """moe_lora_mlp over quantized experts (what fused_expert_forward runs) against grouped_expert_forward, the EP
    engine's per-expert path, with and without LoRA."""
    from moetune.workers.experts.compute import ExpertLoraFactors, GatedActivation, grouped_expert_forward

    quantize, hidden, inter = FORMATS[fmt][0], 96, 32  # gate_up [E, 64, 96] and down [E, 96, 32]: both quantize
    gen = torch.Generator().manual_seed(5)
    counts, rank = [7, 0, 66], 4
    w_gate_up = quantize(torch.randn(3, 2 * inter, hidden, generator=gen) * 0.1)
    w_down = quantize(torch.randn(3, hidden, inter, generator=gen) * 0.2)
    x = torch.randn(sum(counts), hidden, generator=gen).requires_grad_()
    factors = [(torch.randn(*s, generator=gen) * 0.3).requires_grad_() for s in
               ((3, rank, hidden), (3, 2 * inter, rank), (3, rank, inter), (3, hidden, rank))]
    activation = GatedActivation(torch.nn.functional.silu, limit=7.0)
    grad = torch.randn(sum(counts), hidden, generator=gen)
    w_gate_up, w_down, x, factors, grad = to_device(backend_device(backend), w_gate_up, w_down, x, factors, grad)
    tol = 1e-6 if backend == "torch" else TOLERANCE[torch.float32]
    for lora in (None, ExpertLoraFactors(*factors, 0.5)):
        leaves = [x, *factors] if lora else [x]
        expected = grouped_expert_forward(x, counts, w_gate_up, w_down, activation, lora)
        exp_grads = torch.autograd.grad(expected, leaves, grad)
        out = moe_lora_mlp(x, counts, w_gate_up, w_down, activation, *(factors if lora else ()), scaling=0.5,
                           backend=backend)
        grads = torch.autograd.grad(out, leaves, grad)
        for got, want in zip((out, *grads), (expected, *exp_grads)):
            assert rmse_ratio(got, want) <= tol


