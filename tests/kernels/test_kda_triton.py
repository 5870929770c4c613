"""The Triton KDA kernels without a GPU: run through TRITON_INTERPRET against the oracle (forward and every
gradient; in a child process, see tests.support.triton_child), and compiled for sm_90 to catch shape, dtype and resource
errors that the interpreter lets through."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moetune.kernels.kda import naive_recurrent_kda, triton_kda
from moetune.kernels.kda.triton_kda import _sequence, _state_offset
from tests.support.kda_cases import BF16_TOL, FP32_TOL, NAMES, as_fp32, make_inputs, rmse_ratio, run_with_grads
from tests.support.triton_child import (  # noqa: F401 (test_interpreter_run: collected here)
    backend_device,
    on_triton,
    test_interpreter_run,
    to_device,
)

GRADIENTS = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _worst_error(ours: dict, ref: dict) -> float:
    assert all(bool(torch.isfinite(x).all()) for x in ours.values())
    return max(rmse_ratio(ours[key], ref[key]) for key in GRADIENTS)


@on_triton
def test_interpreted_matches_oracle_fp32():
    inputs = to_device(backend_device(), make_inputs(2, 45, 2, 16, 32, gate_scale=4.0))  # 45: a full + partial chunk
    ours = run_with_grads(triton_kda.chunk_kda_triton, inputs)
    assert _worst_error(ours, run_with_grads(naive_recurrent_kda, inputs)) <= FP32_TOL


@on_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float16, FP32_TOL), (torch.bfloat16, BF16_TOL)])
def test_interpreted_low_precision_inputs(dtype, tol):
    """fp16/bf16 in and out (tiles are fp32 inside, so bf16 works under the interpreter too); the oracle runs on
    the same rounded inputs in fp32, so what differs is the rounding of the results."""
    inputs = to_device(backend_device(), make_inputs(1, 40, 2, 16, 16, dtype=dtype))
    ours = run_with_grads(triton_kda.chunk_kda_triton, inputs)
    assert {ours[key].dtype for key in ("o", "dq", "dk", "dv", "dg", "dbeta")} == {dtype}
    assert _worst_error(ours, run_with_grads(naive_recurrent_kda, as_fp32(inputs))) <= tol


@on_triton
def test_interpreted_packed_with_empty_segments():
    cu_seqlens = torch.tensor([0, 0, 33, 33, 50], device=backend_device())  # zero-length segments first and middle
    inputs = to_device(backend_device(), make_inputs(1, 50, 1, 16, 16, n_states=4))
    ours = run_with_grads(triton_kda.chunk_kda_triton, inputs, cu_seqlens)
    assert _worst_error(ours, run_with_grads(naive_recurrent_kda, inputs, cu_seqlens)) <= FP32_TOL
    assert torch.equal(ours["final"][2], inputs["h0"][2].detach())  # an empty segment passes its state on


@on_triton
def test_interpreted_without_states():
    inputs = to_device(backend_device(), make_inputs(1, 20, 1, 16, 16))
    args = [inputs[n] for n in NAMES[:5]]
    o, final = triton_kda.chunk_kda_triton(*args)
    ref, _ = naive_recurrent_kda(*args)
    o.sum().backward()
    with torch.no_grad():  # inference: no per-chunk states kept
        o_inference, _ = triton_kda.chunk_kda_triton(*args)
    assert final is None and all(inputs[n].grad is not None for n in NAMES[:5])
    assert rmse_ratio(o, ref) <= FP32_TOL and rmse_ratio(o_inference, ref) <= FP32_TOL


@triton.jit
def _state_offset_probe(cu_seqlens, chunk_offsets, out, i_nh, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """The kernels' state offset of program row i_nh (an int32, as a program id is)."""
    i_n, i_h, _, _, _ = _sequence(cu_seqlens, chunk_offsets, i_nh, H)
    tl.store(out, _state_offset(i_n, i_h, H, K, V))


@on_triton
def test_interpreted_state_offsets_past_int32():
    """The last head of the 4097th packed sequence at H = 32, K = V = 128: its h0/ht/dh0 state starts at
    (4096·32 + 31)·128² > 2^31, which int32 arithmetic wraps to a negative offset."""
    heads, width, row = 32, 128, 4096 * 32 + 31
    cu_seqlens = torch.arange(4098, dtype=torch.int32, device=backend_device())
    out = torch.zeros(1, dtype=torch.int64, device=backend_device())
    _state_offset_probe[(1,)](cu_seqlens, cu_seqlens, out, row, H=heads, K=width, V=width)
    assert out.item() == row * width * width > 2**31
