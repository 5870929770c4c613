"""MoE grouped GEMM with fused LoRA against the per-expert loop: forward, dX, dA and dB, W frozen; experts with no
tokens, widths that are not multiples of the block sizes; both the grouped_mm path and the Triton kernels (through
the interpreter on CPU), plus an sm_90 compile of the kernels."""

from __future__ import annotations

import pytest
import torch

from moetune.kernels.moe import moe_lora_grouped, moe_lora_mlp
from moetune.kernels.testing import rmse_ratio
from tests.support.moe_reference import check_grouped
from tests.support.triton_child import (  # noqa: F401 (test_interpreter_run: collected here)
    backend_device,
    on_triton,
    test_interpreter_run,
    to_device,
)


def _inputs(dtype, d_in=40, d_out=72, rank=4, counts=(5, 0, 70, 3, 0), seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    n_experts, n_rows = counts.numel(), int(counts.sum())
    x = torch.randn(n_rows, d_in, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(n_experts, d_in, d_out, generator=gen) * d_in ** -0.5).to(dtype).requires_grad_(False)
    a = (torch.randn(n_experts, d_in, rank, generator=gen) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(n_experts, rank, d_out, generator=gen) * 0.3).to(dtype).requires_grad_()
    grad = torch.randn(n_rows, d_out, generator=gen).to(dtype)
    return x, counts, w, a, b, grad


def _check(backend, dtype, tol, **shape):
    x, counts, w, a, b, grad = to_device(backend_device(backend), *_inputs(dtype, **shape))
    empty = [e for e, n in enumerate(counts.tolist()) if n == 0]  # experts without tokens: no LoRA gradient at all
    check_grouped(backend, x, counts, w, w.float(), a, b, grad, tol, empty)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.005), (torch.bfloat16, 0.01)])
def test_grouped_mm_path_matches_the_loop(dtype, tol):
    _check("torch", dtype, tol)


def test_grouped_mm_path_falls_back_to_the_loop_for_unaligned_widths():
    _check("torch", torch.bfloat16, 0.01, d_in=20, d_out=36)


@on_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 0.005), (torch.float16, 0.005), (torch.bfloat16, 0.01)])
def test_triton_kernels_match_the_loop(dtype, tol):
    _check("triton", dtype, tol)


@on_triton
def test_triton_kernels_with_a_large_rank_and_all_rows_on_one_expert():
    _check("triton", torch.float32, 0.005, d_in=33, d_out=130, rank=200, counts=(0, 0, 131, 0, 0))


@on_triton
@pytest.mark.parametrize("rank", [512, 1024])
def test_triton_ranks_beyond_one_fused_tile(rank):
    """Ranks the API allows but one fused tile cannot hold on sm_90 (triton_impl.FUSED_RANK_MAX): xA and (xA)B run
    as their own grouped GEMMs, with the same results."""
    from moetune.kernels.moe.triton_impl import FUSED_RANK_MAX

    assert rank > FUSED_RANK_MAX
    _check("triton", torch.float32, 0.005, d_in=32, d_out=48, rank=rank, counts=(3, 0, 70))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
def test_no_tokens_at_all(backend):
    """A rank whose experts got no token this step still gives (zero) LoRA gradients for every expert."""
    x, counts, w, a, b, grad = to_device(backend_device(backend), *_inputs(torch.float32, counts=(0, 0, 0, 0, 0)))
    out = moe_lora_grouped(x, counts, w, a, b, 2.0, backend=backend)
    assert out.shape == (0, w.shape[2])
    da, db = torch.autograd.grad(out, (a, b), grad)
    assert da.shape == a.shape and db.shape == b.shape and da.abs().max() == 0 and db.abs().max() == 0


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
def test_frozen_weight_gets_no_gradient_and_bad_arguments_are_named(backend):
    x, counts, w, a, b, grad = to_device(backend_device(backend), *_inputs(torch.float32))
    w.requires_grad_()
    moe_lora_grouped(x, counts, w, a, b, 2.0, backend=backend).backward(grad)
    assert w.grad is None and a.grad is not None
    with pytest.raises(ValueError, match="number of experts"):
        moe_lora_grouped(x, counts[:-1], w, a, b, 2.0)
    with pytest.raises(ValueError, match="backend"):
        moe_lora_grouped(x, counts, w, a, b, 2.0, backend="loop")


def _swiglu(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate.clamp(max=1.0)) * up  # clamped, as GLM's experts do


def _expert_mlp_loop(x, counts, w_gate_up, w_down, factors, scaling):
    """The expert MLP written per expert in transformers' F.linear layout, LoRA as PEFT computes it."""
    out, start = [], 0
    for e, n in enumerate(counts):
        xs = x[start:start + n]
        start += n
        gu = xs @ w_gate_up[e].T
        if factors:
            gu = gu + scaling * (xs @ factors[0][e].T) @ factors[1][e].T
        h = _swiglu(gu)
        y = h @ w_down[e].T
        if factors:
            y = y + scaling * (h @ factors[2][e].T) @ factors[3][e].T
        out.append(y)
    return torch.cat(out)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
@pytest.mark.parametrize("with_lora", [True, False])
def test_expert_mlp_matches_the_per_expert_loop(backend, with_lora):
    gen = torch.Generator().manual_seed(3)
    counts, hidden, inter, rank = [3, 0, 20, 9], 32, 24, 4
    x = torch.randn(sum(counts), hidden, generator=gen).requires_grad_()
    w_gate_up = torch.randn(4, 2 * inter, hidden, generator=gen) * 0.2
    w_down = torch.randn(4, hidden, inter, generator=gen) * 0.2
    factors = [(torch.randn(*shape, generator=gen) * 0.3).requires_grad_() for shape in
               ((4, rank, hidden), (4, 2 * inter, rank), (4, rank, inter), (4, hidden, rank))] if with_lora else []
    grad = torch.randn(sum(counts), hidden, generator=gen)
    x, w_gate_up, w_down, factors, grad = to_device(backend_device(backend), x, w_gate_up, w_down, factors, grad)
    expected = _expert_mlp_loop(x, counts, w_gate_up, w_down, factors, 0.5)
    exp_grads = torch.autograd.grad(expected, [x, *factors], grad)
    out = moe_lora_mlp(x, counts, w_gate_up, w_down, _swiglu, *factors, scaling=0.5, backend=backend)
    grads = torch.autograd.grad(out, [x, *factors], grad)
    for got, want in zip((out, *grads), (expected, *exp_grads)):
        assert rmse_ratio(got, want) <= 0.005


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=on_triton)])
def test_expert_mlp_is_a_drop_in_for_the_expert_parallel_compute(backend):
    """Same arguments, layouts, results and LoRA gradients as workers.expert_compute.grouped_expert_forward (the EP
    engine's per-expert path), so that function can hand its work to this one."""
    from moetune.workers.experts.compute import (
        ExpertLoraFactors,
        GatedActivation,
        grouped_expert_forward,
    )

    gen = torch.Generator().manual_seed(4)
    counts, hidden, inter, rank = [7, 0, 12], 32, 16, 4
    x = torch.randn(sum(counts), hidden, generator=gen).requires_grad_()
    w_gate_up, w_down = torch.randn(3, 2 * inter, hidden, generator=gen), torch.randn(3, hidden, inter, generator=gen)
    factors = [torch.randn(*s, generator=gen).requires_grad_() for s in
               ((3, rank, hidden), (3, 2 * inter, rank), (3, rank, inter), (3, hidden, rank))]
    activation = GatedActivation(torch.nn.functional.silu, limit=7.0)  # GLM's swiglu_limit clamp
    grad = torch.randn(sum(counts), hidden, generator=gen)
    x, w_gate_up, w_down, factors, grad = to_device(backend_device(backend), x, w_gate_up, w_down, factors, grad)
    expected = grouped_expert_forward(x, counts, w_gate_up, w_down, activation, ExpertLoraFactors(*factors, 0.5))
    exp_grads = torch.autograd.grad(expected, [x, *factors], grad)
    out = moe_lora_mlp(x, counts, w_gate_up, w_down, activation, *factors, scaling=0.5, backend=backend)
    grads = torch.autograd.grad(out, [x, *factors], grad)
    for got, want in zip((out, *grads), (expected, *exp_grads)):
        assert rmse_ratio(got, want) <= 1e-5


@pytest.mark.parametrize("path", ["loop", "torch", pytest.param("triton", marks=on_triton)])
def test_autograd_keeps_the_frozen_weights_themselves_so_zero3_can_release_them(path):
    """Under ZeRO-3 a gathered expert weight is freed after its module's forward (the Parameter's .data emptied)
    and gathered again before the module's backward. No tensor autograd saved may be a view of it: such a view
    keeps the whole gathered weight alive until the backward. Released and gathered again here the same way
    (the per-expert loop, the grouped_mm path and the Triton kernel), the gradients are an untouched run's."""
    from moetune.workers.experts.compute import ExpertLoraFactors, GatedActivation, grouped_expert_forward

    gen = torch.Generator().manual_seed(6)
    counts, hidden, inter, rank = [7, 0, 12], 32, 16, 4
    device = backend_device(path)
    weights = [torch.nn.Parameter((torch.randn(*s, generator=gen) * 0.2).to(device), requires_grad=False)
               for s in ((3, 2 * inter, hidden), (3, hidden, inter))]
    factors = [(torch.randn(*s, generator=gen) * 0.3).requires_grad_() for s in
               ((3, rank, hidden), (3, 2 * inter, rank), (3, rank, inter), (3, hidden, rank))]
    x, grad = torch.randn(sum(counts), hidden, generator=gen).requires_grad_(), torch.randn(sum(counts), hidden)
    x, factors, grad = to_device(device, x, factors, grad)
    activation = GatedActivation(torch.nn.functional.silu)

    def run():
        if path == "loop":
            return grouped_expert_forward(x, counts, *weights, activation, ExpertLoraFactors(*factors, 0.5))
        return moe_lora_mlp(x, counts, *weights, activation, *factors, scaling=0.5, backend=path)

    want = torch.autograd.grad(run(), [x, *factors], grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = run()
    gathered = [w.data for w in weights]
    for w in weights:  # what ZeRO-3 does after the forward
        w.data = torch.empty(0, device=device)
    storages = {g.untyped_storage().data_ptr() for g in gathered}
    assert [t.shape for t in saved if t.untyped_storage().data_ptr() in storages] == []
    for w, g in zip(weights, gathered):  # and before the backward
        w.data = g
    got = torch.autograd.grad(out, [x, *factors], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_cuda_choice_keeps_quantized_unaligned_and_fp32_on_the_triton_kernel():
    """Only the Triton kernel reads quantized weights; torch's CUDA grouped_mm takes aligned bf16 only."""
    from moetune.kernels.moe.choice import cuda_backend

    x = torch.empty(8, 4096, dtype=torch.bfloat16)
    assert cuda_backend(x, torch.empty(2, 4096, 2048, dtype=torch.bfloat16), quantized=True) == "triton"
    assert cuda_backend(x[:, :4093], torch.empty(2, 2048, 4093, dtype=torch.bfloat16), quantized=False) == "triton"
    assert cuda_backend(x.float(), torch.empty(2, 2048, 4096), quantized=False) == "triton"
