"""Inputs and comparison helpers shared by the KDA tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

NAMES = ("q", "k", "v", "g", "beta", "h0")
FP32_TOL = 0.005  # fla's bar for fp32 (RMSE ratio)
BF16_TOL = 0.01  # bf16 inputs and results, fp32 inside: what remains is the rounding of the stored results


def rmse_ratio(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """fla's error metric: RMSE of the difference over the RMS of the reference."""
    ours, ref = ours.double(), ref.double()
    return ((ours - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def make_inputs(batch, seq_len, heads, dk, dv, n_states=None, dtype=torch.float32, gate_scale=1.0, seed=0):
    """Unit-norm q/k, β in (0, 1), per-channel log-decays g <= 0 (`gate_scale` sets how strong), a random h0."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, seq_len, heads, dk, generator=gen), dim=-1)
    v = torch.randn(batch, seq_len, heads, dv, generator=gen)
    g = -torch.rand(batch, seq_len, heads, dk, generator=gen) * gate_scale
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    h0 = torch.randn(n_states or batch, heads, dk, dv, generator=gen)
    return {name: x.to(dtype).requires_grad_() for name, x in zip(NAMES, (q, k, v, g, beta, h0))}


def run_with_grads(fn, inputs, cu_seqlens=None, seed=1):
    """Output, final state and the gradients of every input under random output and final-state cotangents."""
    for x in inputs.values():
        x.grad = None
    o, final = fn(*(inputs[n] for n in NAMES[:5]), initial_state=inputs["h0"], output_final_state=True,
                  cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.device, o.dtype)
    dht = torch.randn(final.shape, generator=gen).to(final.device)
    ((o.float() * do.float()).sum() + (final * dht).sum()).backward()
    return {"o": o, "final": final, **{f"d{n}": inputs[n].grad for n in NAMES}}


def as_fp32(inputs):
    """The same values in fp32, as fresh leaves (the oracle runs on the rounded low-precision values)."""
    return {n: x.detach().float().requires_grad_() for n, x in inputs.items()}
