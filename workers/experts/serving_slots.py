"""The routed experts' serving slots: each token's expert LoRA from the adapter slot of its row (workers.lora.row_slots
holds the slots and the linears' side), computed as the expert-parallel module trains it when one adapter serves
the whole forward.

A decode step reads nothing back from the device here (on CUDA each read is a host sync per MoE layer per token):
the routing counts stay a device tensor (index_add, where bincount reads the largest index back), and the uniform
path's LoRA scaling, a kernel argument, comes from the host copy kept when the adapter was loaded.
"""

from __future__ import annotations

import torch
from torch import nn

from moetune.kernels.moe import moe_lora_grouped
from moetune.kernels.quant import QuantizedWeight
from moetune.workers.experts.compute import ExpertLoraFactors
from moetune.workers.lora.row_slots import RowSelection, SlotFactors


class ExpertSlotFactors(SlotFactors):
    """SlotFactors that also keep each slot's scaling on the host, as the device holds it (rounded to the dtype)."""

    def __init__(self, slots: int, *args, **kwargs):
        super().__init__(slots, *args, **kwargs)
        self.host_scaling = [0.0] * slots

    def put(self, slot: int, factors: dict[str, torch.Tensor] | None, scaling: float) -> None:
        super().put(slot, factors, scaling)
        self.host_scaling[slot] = float(self.scaling[slot])  # once per adapter load, not per step


class RowLoraExperts(nn.Module):
    """A family's routed experts (held by moetune's experts module at EP=1: dense or quantized, transposed
    families turned) with each token's expert LoRA on gate_up (or up) and down."""

    FACTORS = ("gate_up_a", "gate_up_b", "down_a", "down_b")

    def __init__(self, experts: nn.Module, selection: RowSelection, slots: int, dtype, device,
                 transposed: bool = False):
        super().__init__()
        self.experts, self.selection, self.dtype = experts, selection, dtype  # dtype: the model's compute dtype
        self.transposed = transposed  # the checkpoint's tensors are [E, in, out] (moetune's module turned them)
        w_in, w_down = experts.base_weights()
        e, two_i, hidden = w_in.shape
        intermediate = w_down.shape[2]
        self.factors = ExpertSlotFactors(slots, {"gate_up_a": ((e, 0, hidden), 1), "gate_up_b": ((e, two_i, 0), 2),
                                            "down_a": ((e, 0, intermediate), 1), "down_b": ((e, hidden, 0), 2)},
                                          dtype, device)

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    def forward(self, hidden_states, top_k_index, top_k_weights):
        sel, f, ex = self.selection, self.factors, self.experts
        top_k = top_k_index.shape[-1]
        flat_experts = top_k_index.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)  # (token, choice) pairs grouped by expert
        token_of = order // top_k
        counts = torch.zeros(ex.num_experts, dtype=torch.long, device=flat_experts.device)
        counts.index_add_(0, flat_experts, torch.ones_like(flat_experts))
        rows = hidden_states[token_of]
        biases = (ex.gate_up_proj_bias, ex.down_proj_bias) if ex.biased else None
        if sel.uniform is not None or not sel.slots & f.filled:  # one adapter or none: the compute as trained
            s = sel.uniform
            lora = (ExpertLoraFactors(*(f.of(n, s) for n in self.FACTORS), f.host_scaling[s])
                    if s is not None and s in f.filled else None)
            y = ex.compute(rows, counts, *ex.base_weights(), ex.activation, lora, biases)
        else:
            y = self._mixed(rows, counts, sel.slots_of(hidden_states.shape[0])[token_of], flat_experts[order], biases)
        weights = top_k_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token_of, (y * weights).to(out.dtype))

    def _mixed(self, rows, counts, slots, expert_of, biases):
        """Rows sorted by expert, each with its own adapter slot: the frozen projections grouped by expert, each
        row's low-rank update gathered from its (slot, expert) factors."""
        f, ex = self.factors, self.experts
        w_in, w_down = ex.base_weights()
        factor_rows = f.row_of[slots]  # a slot without expert LoRA reads row 0, scaled by 0

        def project(x, w, bias, a, b):
            frozen = w if isinstance(w, QuantizedWeight) else w.transpose(1, 2)  # kernels.moe's [E, in, out]
            y = moe_lora_grouped(x, counts, frozen, None, None, 0.0)
            if bias is not None:
                y = y + bias[expert_of]
            lowrank = torch.bmm(f[a][factor_rows, expert_of], x.unsqueeze(-1).to(self.dtype))
            delta = torch.bmm(f[b][factor_rows, expert_of], lowrank).squeeze(-1) * f.scaling[slots, None]
            return y + delta.to(y.dtype)

        gate_up_bias, down_bias = biases if biases is not None else (None, None)
        hidden = ex.activation(project(rows, w_in, gate_up_bias, "gate_up_a", "gate_up_b"))
        return project(hidden, w_down, down_bias, "down_a", "down_b")
