"""The adapter slots' factor stacks (workers.lora.row_slots.SlotFactors): one row per slot holding factors, a slot
refilled in place, a freed row's memory returned, each slot reading its own factors after the rows move."""

from __future__ import annotations

import torch

from moetune.workers.lora.row_slots import SlotFactors


def _factors(rank: int, value: float) -> dict[str, torch.Tensor]:
    return {"a": torch.full((3, rank, 5), value), "b": torch.full((3, 7, rank), value)}


def _reads(f: SlotFactors, slot: int) -> float:
    """The value slot `slot`'s A factor holds, read as a mixed batch gathers it (through row_of)."""
    return f["a"][f.row_of[torch.tensor([slot])]][0, 0, 0, 0].item()


def row_bytes(rank: int) -> int:
    return (3 * rank * 5 + 3 * 7 * rank) * 4


def test_rows_follow_the_slots_that_hold_factors():
    f = SlotFactors(5, {"a": ((3, 0, 5), 1), "b": ((3, 7, 0), 2)}, torch.float32, "cpu")
    assert f.nbytes() == 0  # no adapter: nothing held
    f.put(1, _factors(2, 1.0), 0.5)
    f.put(3, _factors(4, 3.0), 0.25)
    assert f.nbytes() == 2 * row_bytes(4) and f.filled == {1, 3}
    f.put(1, _factors(2, 5.0), 0.5)  # slot 1 refilled by another adapter: in place
    assert f.nbytes() == 2 * row_bytes(4) and (_reads(f, 1), _reads(f, 3)) == (5.0, 3.0)
    f.put(1, None, 0.5)  # an adapter without factors here takes slot 1: its row goes, slot 3's row moves
    assert f.nbytes() == row_bytes(4) and f.filled == {3} and _reads(f, 3) == 3.0
    assert f.of("a", 3)[0, :, 0].tolist() == [3.0] * 4 and float(f.scaling[1]) == 0.0
    f.put(2, _factors(1, 2.0), 1.0)  # a smaller rank: zeros beyond it
    assert f.of("a", 2)[0, :, 0].tolist() == [2.0, 0.0, 0.0, 0.0] and _reads(f, 3) == 3.0
