"""The routed-expert compute: one call over all of a rank's local experts.

Two interchangeable functions with one contract: `fused_expert_forward` (kernels.moe: grouped GEMMs with fused
LoRA, Triton on CUDA, torch's grouped_mm elsewhere; what jobs run with `training.custom_kernels`) and
`grouped_expert_forward` (a per-expert PyTorch loop: kernels off, quantized frozen experts (each expert's weight
dequantized a tile at a time, never all of them), biased experts, and the oracle the kernels are tested against).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.kernels.moe import moe_lora_mlp
from moetune.kernels.quant import QuantizedWeight, quantized_linear


@dataclass
class ExpertLoraFactors:
    """Per-expert low-rank factors (local experts only): y = xWᵀ + scaling·(xAᵀ)Bᵀ."""

    gate_up_a: object  # (experts, r, hidden)
    gate_up_b: object  # (experts, 2·intermediate, r)
    down_a: object  # (experts, r, intermediate)
    down_b: object  # (experts, hidden, r)
    scaling: float


def _project(x, weight, a, b, scaling, bias=None):
    """x @ weightᵀ (+ bias), plus the low-rank path computed from the factors (W + ΔW is never formed). A quantized
    weight is dequantized a tile of rows at a time, forward and backward (kernels.quant)."""
    y = quantized_linear(x, weight) if isinstance(weight, QuantizedWeight) else x @ weight.transpose(0, 1)
    if bias is not None:
        y = y + bias
    if a is not None:
        y = y + scaling * ((x @ a.transpose(0, 1)) @ b.transpose(0, 1))
    return y


def _expert_factors(lora: ExpertLoraFactors | None, e: int) -> tuple:
    if lora is None:
        return None, None, None, None, 0.0
    return lora.gate_up_a[e], lora.gate_up_b[e], lora.down_a[e], lora.down_b[e], lora.scaling


def _expert(weights, e: int):
    return weights.expert(e) if isinstance(weights, QuantizedWeight) else weights[e]


class GatedActivation:
    """gate_up -> act(gate) · up, with the optional clamping some families apply (GLM: `swiglu_limit`)."""

    def __init__(self, act_fn, limit: float | None = None):
        self.act_fn, self.limit = act_fn, limit

    def __call__(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up


def grouped_expert_forward(x_sorted, counts: list[int], w_gate_up, w_down, activation,
                           lora: ExpertLoraFactors | None = None, biases: tuple | None = None):
    """Expert MLP over tokens sorted by local expert; `counts[e]` tokens belong to local expert e. `biases`:
    (gate_up [E, 2I], down [E, H]) for families whose experts have them (gpt-oss).

    Every local expert runs, also with zero tokens, so every weight is part of every step's graph.
    """
    import torch

    outputs = []
    for e, xs in enumerate(torch.split(x_sorted, counts)):
        gu_a, gu_b, d_a, d_b, scaling = _expert_factors(lora, e)
        gu_bias, d_bias = (biases[0][e], biases[1][e]) if biases is not None else (None, None)
        hidden = activation(_project(xs, _expert(w_gate_up, e), gu_a, gu_b, scaling, gu_bias))
        outputs.append(_project(hidden, _expert(w_down, e), d_a, d_b, scaling, d_bias))
    return torch.cat(outputs)


def fused_expert_forward(x_sorted, counts: list[int], w_gate_up, w_down, activation,
                         lora: ExpertLoraFactors | None = None, biases: None = None):
    """grouped_expert_forward's contract for unbiased experts, computed by kernels.moe (W frozen, W + ΔW never
    formed)."""
    if biases is not None:
        raise ValueError("kernels.moe has no expert biases: biased experts run grouped_expert_forward")
    if lora is None:
        return moe_lora_mlp(x_sorted, counts, w_gate_up, w_down, activation)
    return moe_lora_mlp(x_sorted, counts, w_gate_up, w_down, activation, lora.gate_up_a, lora.gate_up_b,
                        lora.down_a, lora.down_b, scaling=lora.scaling)
