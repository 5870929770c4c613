"""K3's SiTU-GLU (workers.families.kimi_k3.modeling.situ_glu) against the formula as autograd runs it: the same
values and gradients (bit for bit in fp32, within bf16's rounding in bf16), while keeping only its input for the
backward, in the input's dtype."""

import pytest
import torch

from moetune.workers.families.kimi_k3 import modeling
from moetune.workers.families.kimi_k3.modeling import situ_glu
from moetune.workers.planner.saved import SavedBytes

BETA, LINEAR_BETA = 4.0, 25.0  # the release's activation_situ_beta / activation_situ_linear_beta


def _formula(gate_up, beta, linear_beta):
    """The activation's definition, differentiated by autograd, in fp32."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    activated = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    return activated * up


def _value_and_grad(fn, gate_up, grad):
    x = gate_up.detach().clone().requires_grad_()
    out = fn(x)
    out.backward(grad)
    return out, x.grad


def _inputs(dtype):
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(64, 2 * 48, generator=generator) * 8  # past both tanh knees (±beta, ±linear_beta)
    gate_up[0, :4] = torch.tensor([0.0, -60.0, 60.0, 1e-3])
    grad = torch.randn(64, 48, generator=generator)
    return gate_up.view(4, 16, 96).to(dtype), grad.view(4, 16, 48).to(dtype)  # [batch, tokens, 2I], as the MLPs


@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
@pytest.mark.parametrize("rows", [modeling._ROWS, 7])  # one pass; 10 blocks of rows, the last short
def test_fp32_values_and_gradients_are_the_formula(linear_beta, rows, monkeypatch):
    monkeypatch.setattr(modeling, "_ROWS", rows)
    gate_up, grad = _inputs(torch.float32)
    out, d = _value_and_grad(lambda x: situ_glu(x, BETA, linear_beta), gate_up, grad)
    want, want_d = _value_and_grad(lambda x: _formula(x, BETA, linear_beta), gate_up, grad)
    assert torch.equal(out, want)
    assert torch.equal(d, want_d)


@pytest.mark.parametrize("linear_beta", [LINEAR_BETA, None])
def test_bf16_in_and_out_within_bf16_rounding_of_the_fp32_formula(linear_beta):
    gate_up, grad = _inputs(torch.bfloat16)
    out, d = _value_and_grad(lambda x: situ_glu(x, BETA, linear_beta), gate_up, grad)
    want, want_d = _value_and_grad(lambda x: _formula(x, BETA, linear_beta), gate_up.float(), grad.float())
    assert out.dtype == d.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16))  # one rounding, of the fp32 result
    torch.testing.assert_close(d.float(), want_d, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_only_the_input_is_kept_for_the_backward(dtype):
    gate_up = torch.randn(256, 2 * 64, dtype=dtype, requires_grad=True)  # [routed slots, 2I], as the experts
    with SavedBytes(torch.nn.Linear(1, 1)).counting() as counter:
        out = situ_glu(gate_up, BETA, LINEAR_BETA)
    assert out.dtype == dtype and counter.total == gate_up.nbytes
