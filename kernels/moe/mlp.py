"""A whole expert MLP (gate/up projection, GLU, down projection) over tokens sorted by local expert, each projection
a grouped GEMM with fused LoRA. Weights in transformers' fused-expert layout (or QuantizedWeights, which have it),
LoRA factors in PEFT's layout."""

from __future__ import annotations

import torch

from moetune.kernels.moe.function import moe_lora_linear


def _t(x):
    """A PEFT-layout LoRA factor [E, out, in] to the grouped GEMM's [E, in, out]."""
    return x if x is None else x.transpose(1, 2)


def moe_lora_mlp(x_sorted, counts, w_gate_up, w_down, activation, gate_up_a=None, gate_up_b=None, down_a=None,
                 down_b=None, scaling: float = 1.0, backend: str | None = None) -> torch.Tensor:
    """x_sorted [N, H]; counts [E] (tensor or list); w_gate_up [E, 2I, H]; w_down [E, H, I] (dense or
    QuantizedWeight); activation maps the gate/up projection [N, 2I] to [N, I] (the family's GLU, e.g.
    silu(gate) * up, clamped or not); LoRA factors A [E, r, in] and B [E, out, r] (or None). Returns [N, H]."""
    counts = torch.as_tensor(counts, device=x_sorted.device)
    gate_up = moe_lora_linear(x_sorted, counts, w_gate_up, _t(gate_up_a), _t(gate_up_b), scaling, backend)
    return moe_lora_linear(activation(gate_up), counts, w_down, _t(down_a), _t(down_b), scaling, backend)
