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


class SlotFactors(nn.Module):
    """The (A, B) factors of the slots whose adapter adapts this module, stacked one row per such slot, and each
    slot's scaling (0: none). Memory follows the adapters loaded here, not the slots: the base and adapters that
    leave this module alone hold no row (an expert LoRA of 896 experts at rank 16 is ~0.6 GB per layer per row)."""

    def __init__(self, slots: int, shapes: dict[str, tuple[tuple[int, ...], int]], dtype, device):
        super().__init__()
        self.rank_dims = {name: rank_dim for name, (_, rank_dim) in shapes.items()}
        # [rows, *shape], the rank grown to the largest loaded (zeros beyond a smaller rank: exact)
        self.stacks = {name: torch.zeros(0, *shape, dtype=dtype, device=device) for name, (shape, _) in shapes.items()}
        self.scaling = torch.zeros(slots, dtype=dtype, device=device)
        self.rows: dict[int, int] = {}  # slot -> its row, for the slots with factors
        # the same on the device, per slot; a slot without factors reads row 0, which its zero scaling cancels
        self.row_of = torch.zeros(slots, dtype=torch.long, device=device)

    @property
    def filled(self) -> set[int]:
        return set(self.rows)

    def put(self, slot: int, factors: dict[str, torch.Tensor] | None, scaling: float) -> None:
        if factors is None:
            self._drop(slot)
        else:
            self._fill(slot, factors)
        self.scaling[slot] = scaling if factors is not None else 0.0

    def _fill(self, slot: int, factors: dict[str, torch.Tensor]) -> None:
        row = self.rows.setdefault(slot, len(self.rows))
        for name, data in self.stacks.items():
            value, rank_dim = factors[name].to(data.dtype), self.rank_dims[name]
            grow_rows = max(row + 1 - data.shape[0], 0)  # a new row, else overwritten in place
            grow_rank = max(value.shape[rank_dim] - data.shape[rank_dim + 1], 0)
            if grow_rows or grow_rank:
                pad = [0, 0] * (data.dim() - 2 - rank_dim) + [0, grow_rank] + [0, 0] * rank_dim + [0, grow_rows]
                data = self.stacks[name] = nn.functional.pad(data, pad)
            target = data[row]
            target.zero_()
            target.narrow(rank_dim, 0, value.shape[rank_dim]).copy_(value)
        self.row_of[slot] = row

    def _drop(self, slot: int) -> None:
        """Frees the slot's row: the last row moves into it, and the stacks shrink by one row (copied, so that
        the memory goes)."""
        row = self.rows.pop(slot, None)
        if row is None:
            return
        last = len(self.rows)
        if row != last:
            moved = next(s for s, r in self.rows.items() if r == last)
            for data in self.stacks.values():
                data[row].copy_(data[last])
            self.rows[moved] = row
            self.row_of[moved] = row
        self.stacks = {name: data[:last].clone() for name, data in self.stacks.items()}
        self.row_of[slot] = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        """The stack of factor `name`, [rows, ...]: index it by `rows` / `row_of`, not by slot."""
        return self.stacks[name]

    def of(self, name: str, slot: int) -> torch.Tensor:
        return self.stacks[name][self.rows[slot]]

    def nbytes(self) -> int:
        return sum(data.nbytes for data in self.stacks.values())


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
            delta = (flat @ f.of("a", s).T) @ f.of("b", s).T * f.scaling[s]
        else:  # rows of different adapters: each token its slot's factors (scaled by 0 where it has none)
            slots = sel.slots_of(flat.shape[0])
            rows = f.row_of[slots]
            lowrank = torch.bmm(f["a"][rows], flat.unsqueeze(-1))  # [tokens, r, 1]
            delta = torch.bmm(f["b"][rows], lowrank).squeeze(-1) * f.scaling[slots, None]
        return y + delta.reshape(y.shape).to(y.dtype)
