"""Which byte ranges of which shards one rank needs, and where each lands.

A piece is one checkpoint tensor, or one expert's slice of a fused [E, ...] tensor, together with its
destination: the parameter, the local expert index along dim 0, and the region of a concatenation. Experts
outside this rank's share are never planned, so they are neither read nor allocated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from moetune.workers.weights.errors import WeightsError, tensor_list
from moetune.workers.parallel.placement import ExpertPlacement
from moetune.workers.weights.header import TensorInfo
from moetune.workers.weights.mapping import NameMapper


@dataclass(frozen=True)
class Piece:
    shard: str
    tensor: str
    start: int  # absolute byte range in the shard file
    end: int
    dtype: str
    shape: tuple[int, ...]
    param: str
    index: int | None  # local expert index along the parameter's dim 0
    dim: int | None  # concatenation dim of the (expert) slice
    offset: int  # start along `dim`
    sha256: str | None  # from the manifest; None when the checkpoint has none

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def label(self) -> str:
        return f"{self.shard}: {self.tensor}"

    def destination(self, param):
        view = param if self.index is None else param[self.index]
        return view if self.dim is None else view.narrow(self.dim, self.offset, self.shape[self.dim])


@dataclass
class Plan:
    pieces: list[Piece]
    unexpected: list[str]  # checkpoint tensors the model has no place for (ignored, as transformers does)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def plan_rank(shards: dict[str, dict[str, TensorInfo]], mapper: NameMapper, shapes: dict[str, tuple[int, ...]],
              required: set[str], experts: dict[str, ExpertPlacement], aliases: dict[str, str],
              digests: dict | None) -> Plan:
    """`shapes`: the allocated shape of every parameter/buffer that may be filled (expert parameters hold only
    this rank's share, `experts` says which); `required`: those the checkpoint must cover (the parameters);
    `aliases` maps tied names to the one allocated; `digests`: the manifest's per-tensor checksums."""
    raw, unexpected = [], []
    for shard, tensors in shards.items():
        for info in tensors.values():
            target = mapper.target(info.name)
            if target is None:
                unexpected.append(info.name)
                continue
            param = aliases.get(target.param, target.param)
            digest = (digests or {}).get(info.name, {})
            share = experts.get(param)
            if target.expert is not None:  # a per-expert tensor merged into a fused parameter
                if share is None:
                    raw.append((shard, info, param, target, target.expert, digest.get("sha256"), info.shape))
                elif share.first <= target.expert < share.first + share.count:
                    raw.append((shard, info, param, target, target.expert - share.first, digest.get("sha256"),
                                info.shape))
            elif share is not None and share.count < share.num_experts and info.shape[:1] == (share.num_experts,):
                raw.extend(_expert_slices(shard, info, param, target, share, digest))
            else:
                raw.append((shard, info, param, target, None, digest.get("sha256"), info.shape))
    pieces = _place(raw)
    _check(pieces, shapes, required)
    return Plan(pieces, unexpected)


def _expert_slices(shard, info: TensorInfo, param, target, share: ExpertPlacement, digest):
    """This rank's rows of a fused [E, ...] checkpoint tensor: one contiguous range per local expert."""
    row = info.nbytes // share.num_experts
    slice_digests = digest.get("expert_sha256") or [None] * share.num_experts
    for local in range(share.count):
        e = share.first + local
        part = TensorInfo(f"{info.name}[expert {e}]", info.dtype, info.shape[1:], info.start + e * row,
                          info.start + (e + 1) * row)
        yield shard, part, param, target, local, slice_digests[e], info.shape[1:]


def _place(raw) -> list[Piece]:
    """Pieces with their offsets along concatenation dims (sources in the converter's order)."""
    groups = defaultdict(list)
    for item in raw:
        _, _, param, target, index, _, _ = item
        groups[(param, index, target.concat_dim)].append(item)
    pieces = []
    for (param, index, dim), items in groups.items():
        offset = 0
        for shard, info, _, target, _, sha, shape in sorted(items, key=lambda it: it[3].part):
            pieces.append(Piece(shard, info.name, info.start, info.end, info.dtype, tuple(shape), param, index,
                                dim, offset, sha))
            offset += shape[dim] if dim is not None else 0
    return pieces


def _check(pieces: list[Piece], shapes: dict[str, tuple[int, ...]], required: set[str]) -> None:
    """Every piece fits its destination exactly and every parameter is fully covered; errors list the names."""
    import torch

    metas = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    mismatched, covered = [], defaultdict(int)
    for p in pieces:
        try:
            dest = tuple(p.destination(metas[p.param]).shape)
        except (IndexError, RuntimeError):
            dest = None
        if dest != p.shape:
            mismatched.append(f"{p.tensor} {list(p.shape)} vs model {p.param} {list(shapes[p.param])}")
        covered[p.param] += math.prod(p.shape)
    if mismatched:
        raise WeightsError(f"shape mismatch between checkpoint and model: {tensor_list(mismatched)}")
    missing = [name for name in required if covered[name] != math.prod(shapes[name])]
    if missing:
        raise WeightsError(f"checkpoint lacks tensors for: {tensor_list(missing)}")


def merge_ranges(pieces: list[Piece], gap: int) -> list[tuple[str, int, int]]:
    """(shard, start, end) ranges covering every piece; neighbours closer than `gap` bytes become one read."""
    merged: list[list] = []
    for p in sorted(pieces, key=lambda p: (p.shard, p.start)):
        last = merged[-1] if merged else None
        if last and last[0] == p.shard and p.start - last[2] <= gap:
            last[2] = max(last[2], p.end)
        else:
            merged.append([p.shard, p.start, p.end])
    return [tuple(m) for m in merged]
