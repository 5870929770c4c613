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


def load_batches(plan: Plan, params: dict[str, tuple[tuple[int, ...], int]]) -> list[Batch]:
    """Consecutive units joined while their bytes stay within the largest unit's."""
    units = _units(plan, params)
    cap = max((u.nbytes for u in units), default=0)
    batches: list[Batch] = []
    for unit in units:
        last = batches[-1] if batches else None
        if last is None or last.nbytes + unit.nbytes > cap:
            batches.append(unit)
            continue
        last.params += unit.params
        last.staged.update(unit.staged)
        last.conversions.update(unit.conversions)
        last.pieces += unit.pieces
        last.nbytes += unit.nbytes
    return batches
