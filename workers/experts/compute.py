"""The routed-expert compute: one call over all of a rank's local experts.

Two interchangeable functions with one contract: `fused_expert_forward` (kernels.moe: grouped GEMMs with fused
LoRA, Triton on CUDA, torch's grouped_mm elsewhere; what jobs run with `training.custom_kernels`) and
`grouped_expert_forward` (kernels.moe's per-expert PyTorch loop: kernels off, biased experts, and the oracle the
kernels are tested against). Both take quantized frozen experts, never dequantized whole: the Triton kernel
dequantizes tile by tile, the loops (also kernels.moe's torch backend) a tile of one expert's rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetune.kernels.moe import moe_lora_mlp
from moetune.kernels.moe.torch_impl import moe_lora_per_expert


@dataclass
class ExpertLoraFactors:
    """Per-expert low-rank factors (local experts only): y = xWᵀ + scaling·(xAᵀ)Bᵀ."""

    gate_up_a: object  # (experts, r, hidden)
    gate_up_b: object  # (experts, 2·intermediate, r)
    down_a: object  # (experts, r, intermediate)
    down_b: object  # (experts, hidden, r)
    scaling: float


class GatedActivation:
    """gate_up -> act(gate) · up, with the optional clamping some families apply (GLM: `swiglu_limit`)."""

    def __init__(self, act_fn, limit: float | None = None):
        self.act_fn, self.limit = act_fn, limit

    def __call__(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up


def grouped_expert_forward(x_sorted, counts, w_gate_up, w_down, activation,
                           lora: ExpertLoraFactors | None = None, biases: tuple | None = None):
    """Expert MLP over tokens sorted by local expert; `counts[e]` tokens (a tensor or list) belong to local expert e.
    `biases`: (gate_up [E, 2I], down [E, H]) for families whose experts have them (gpt-oss).

    Every local expert runs, also with zero tokens, so every weight is part of every step's graph. The loop needs
    the counts on the host (a sync per layer, on this path only).
    """
    counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    factors = (None,) * 4 if lora is None else (lora.gate_up_a, lora.gate_up_b, lora.down_a, lora.down_b)
    scaling = 0.0 if lora is None else lora.scaling
    hidden = activation(moe_lora_per_expert(x_sorted, counts, w_gate_up, *factors[:2], scaling, gate_up_bias))
    return moe_lora_per_expert(hidden, counts, w_down, *factors[2:], scaling, down_bias)


def fused_expert_forward(x_sorted, counts, w_gate_up, w_down, activation,
                         lora: ExpertLoraFactors | None = None, biases: None = None):
    """grouped_expert_forward's contract for unbiased experts, computed by kernels.moe (W frozen, W + ΔW never
    formed)."""
    if biases is not None:
        raise ValueError("kernels.moe has no expert biases: biased experts run grouped_expert_forward")
    if lora is None:
        return moe_lora_mlp(x_sorted, counts, w_gate_up, w_down, activation)
    return moe_lora_mlp(x_sorted, counts, w_gate_up, w_down, activation, lora.gate_up_a, lora.gate_up_b,
                        lora.down_a, lora.down_b, scaling=lora.scaling)
