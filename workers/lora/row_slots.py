"""Per-row adapter selection inside one forward (serving): every adapted module holds the LoRA factors of all loaded
adapters stacked by slot (slot 0: none, the base), and adds to each token the update of its row's slot.

PEFT's mixed-adapter batches (`adapter_names=`) cover LoRA linears but not `target_parameters` (its ParamWrapper
refuses them), which is how moetune exports expert LoRA; so both kinds are computed by moetune, the linears here and
the routed experts in workers.experts.serving_slots, from the factors in PEFT's own layouts: linear A (r, in),
B (out, r); expert A (E, r, in), B (E, out, r), y = xWᵀ + s·(xAᵀ)Bᵀ.
"""

from __future__ import annotations

import torch
from torch import nn


class RowSelection:
    """The adapter slot of every row of the forward being run (set by the engine before each forward)."""

    def __init__(self):
        self.slots: set[int] = {0}  # the slots in this forward
        self.row_slots: torch.Tensor | None = None  # [rows]
        self.uniform: int | None = 0  # the one slot of all rows, or None when they differ

    def set(self, row_slots: list[int], device) -> None:
        self.slots = set(row_slots)
        self.uniform = row_slots[0] if len(self.slots) == 1 else None
        self.row_slots = torch.tensor(row_slots, dtype=torch.long, device=device)

    def slots_of(self, n: int) -> torch.Tensor:
        """The slot of each of `n` vectors flattened from a [rows, ...] tensor (tokens, or tokens x heads)."""
        rows = self.row_slots.shape[0]
        if n % rows:
            raise ValueError(f"{n} vectors do not split over {rows} rows")
        return self.row_slots.repeat_interleave(n // rows)


class _Stack:
    """One factor of all slots, [slots, *shape], grown along `rank_dim` when a larger rank comes (zeros: exact)."""

    def __init__(self, slots: int, shape: tuple[int, ...], rank_dim: int, dtype, device):
        self.rank_dim = rank_dim
        self.data = torch.zeros(slots, *shape, dtype=dtype, device=device)

    def put(self, slot: int, value: torch.Tensor | None) -> None:
        if value is None:
            self.data[slot].zero_()
            return
        grow = value.shape[self.rank_dim] - self.data.shape[self.rank_dim + 1]
        if grow > 0:
            pad = [0, 0] * (self.data.dim() - 1 - (self.rank_dim + 1)) + [0, grow]
            self.data = nn.functional.pad(self.data, pad)
        target = self.data[slot]
        target.zero_()
        target.narrow(self.rank_dim, 0, value.shape[self.rank_dim]).copy_(value)


class SlotFactors(nn.Module):
    """The stacked (A, B) pairs of a module and each slot's scaling."""

    def __init__(self, slots: int, shapes: dict[str, tuple[tuple[int, ...], int]], dtype, device):
        super().__init__()
        self.stacks = {name: _Stack(slots, shape, rank_dim, dtype, device) for name, (shape, rank_dim) in
                       shapes.items()}
        self.scaling = torch.zeros(slots, dtype=dtype, device=device)
        self.filled: set[int] = set()

    def put(self, slot: int, factors: dict[str, torch.Tensor] | None, scaling: float) -> None:
        for name, stack in self.stacks.items():
            stack.put(slot, None if factors is None else factors[name].to(stack.data.dtype))
        self.scaling[slot] = scaling if factors is not None else 0.0
        (self.filled.add if factors is not None else self.filled.discard)(slot)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.stacks[name].data

    def nbytes(self) -> int:
        return sum(s.data.nbytes for s in self.stacks.values())


class RowLoraLinear(nn.Module):
    """A linear (dense or quantized, any module mapping [..., in] to [..., out]) plus each row's LoRA."""

    def __init__(self, base: nn.Module, selection: RowSelection, slots: int, in_features: int, out_features: int,
                 dtype, device):
        super().__init__()
        self.base_layer, self.selection = base, selection
        self.factors = SlotFactors(slots, {"a": ((0, in_features), 0), "b": ((out_features, 0), 1)}, dtype, device)

    @property
    def weight(self):  # what model code reads of a linear (its dtype, device), as of PEFT's wrapped linears
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    @property
    def varies_by_row(self) -> bool:
        """Whether this forward's rows see different weights here (families.mla then keeps MLA expanded)."""
        return self.selection.uniform is None and bool(self.selection.slots & self.factors.filled)

    def forward(self, x):
        y = self.base_layer(x)
        sel, f = self.selection, self.factors
        if not sel.slots & f.filled:
            return y  # the base, or adapters that leave this module alone
        flat = x.reshape(-1, x.shape[-1]).to(f["a"].dtype)
        if sel.uniform is not None:  # one adapter for all rows: two plain matmuls, in PEFT's order
            s = sel.uniform
            delta = (flat @ f["a"][s].T) @ f["b"][s].T * f.scaling[s]
        else:  # rows of different adapters: each token its slot's factors (slot 0 is all zeros)
            slots = sel.slots_of(flat.shape[0])
            lowrank = torch.bmm(f["a"][slots], flat.unsqueeze(-1))  # [tokens, r, 1]
            delta = torch.bmm(f["b"][slots], lowrank).squeeze(-1) * f.scaling[slots, None]
        return y + delta.reshape(y.shape).to(y.dtype)
