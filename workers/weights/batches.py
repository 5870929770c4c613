"""The parameters a loader that partitions as it loads (ZeRO-3) fills at once: the plan cut into batches of whole
parameters, none larger than the largest single parameter (with a conversion's staged sources), so that a rank
holds at most that much whole on top of its partitions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moetune.workers.weights.fetch import torch_dtype
from moetune.workers.weights.plan import Piece, Plan


@dataclass
class Batch:
    params: list[str] = field(default_factory=list)
    staged: dict[str, tuple] = field(default_factory=dict)  # staging tensors (name -> (shape, dtype))
    conversions: dict[str, tuple] = field(default_factory=dict)  # as Plan.conversions
    pieces: list[Piece] = field(default_factory=list)
    nbytes: int = 0


def _units(plan: Plan, params: dict[str, tuple[tuple[int, ...], int]]) -> list[Batch]:
    """One batch per parameter, or per conversion (its staged sources and every parameter it produces), in the
    model's order. `params`: name -> (allocated shape, bytes per element) of the dense parameters to fill."""
    by_param: dict[str, list[Piece]] = {}
    for piece in plan.pieces:
        by_param.setdefault(piece.param, []).append(piece)
    produced = {t: layer for layer, (conv, _) in plan.conversions.items() for t in conv.targets}
    units, seen = [], set()
    for name, (shape, itemsize) in params.items():
        layer = produced.get(name)
        if layer in seen:
            continue
        if layer is None:
            units.append(Batch([name], pieces=by_param.get(name, []), nbytes=math.prod(shape) * itemsize))
            continue
        seen.add(layer)
        conv, sources = plan.conversions[layer]
        staged = {stage: plan.staged[stage] for _, stage in sources}
        outputs = [t for t in conv.targets if t in params]
        nbytes = sum(math.prod(params[t][0]) * params[t][1] for t in outputs) + sum(
            math.prod(shape) * torch_dtype(dtype).itemsize for shape, dtype in staged.values())
        units.append(Batch(outputs, staged, {layer: plan.conversions[layer]},
                           [p for stage in staged for p in by_param.get(stage, [])], nbytes))
    return units


def greedy_batches(sizes: list[float]) -> list[list[int]]:
    """Indices of consecutive items joined while their bytes stay within the largest item's (the planner simulates
    the loader with it)."""
    cap = max(sizes, default=0)
    batches: list[list[int]] = []
    total = 0.0
    for i, size in enumerate(sizes):
        if not batches or total + size > cap:
            batches.append([])
            total = 0.0
        batches[-1].append(i)
        total += size
    return batches


def load_batches(plan: Plan, params: dict[str, tuple[tuple[int, ...], int]]) -> list[Batch]:
    """The units (_units) joined by greedy_batches."""
    units = _units(plan, params)
    batches = []
    for indices in greedy_batches([u.nbytes for u in units]):
        batch = Batch()
        for unit in (units[i] for i in indices):
            batch.params += unit.params
            batch.staged.update(unit.staged)
            batch.conversions.update(unit.conversions)
            batch.pieces += unit.pieces
            batch.nbytes += unit.nbytes
        batches.append(batch)
    return batches
