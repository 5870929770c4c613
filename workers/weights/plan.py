"""Which byte ranges of which shards one rank needs, and where each lands.

A piece is one checkpoint tensor, or one expert's slice of a fused [E, ...] tensor, together with its
destination: the parameter (or, for a quantized one, the storage tensor of one of its parts, see
workers.weights.formats; for one converted in memory, a staging tensor, see workers.weights.mapping), the local
expert index along dim 0, and the region of a concatenation. Experts
outside this rank's share are never planned, so they are neither read nor allocated.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from moetune.api.quantization import Quantization
from moetune.workers.experts.placement import ExpertPlacement
from moetune.workers.weights.errors import WeightsError, tensor_list
from moetune.workers.weights.header import TensorInfo
from moetune.workers.weights.formats import (
    QUANTIZED_SUFFIXES,
    Part,
    parse_storage_name,
    required_parts,
    split,
    storage_name,
)
from moetune.workers.weights.manifest import Checksum, expert_checksums, tensor_checksum
from moetune.workers.weights.mapping import NameMapper


STAGED = "#staged"  # suffix of a staging tensor's name (a checkpoint tensor converted after loading)


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
    checksum: Checksum | None  # from the manifest; None when the checkpoint has none

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
    # quantized parameters: storage name (`param:part`) -> (shape, safetensors dtype) of what this rank holds
    storage: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    metadata: list[str] = field(default_factory=list)  # quantization metadata the shapes already imply
    # tensors loaded whole into a staging tensor (name -> (shape, safetensors dtype)), then converted in memory:
    # conversion layer name -> (its Conversion, [(checkpoint tensor, staging name)])
    staged: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    conversions: dict[str, tuple[object, list[tuple[str, str]]]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclass
class MappedCheckpoint:
    """A checkpoint's tensors with their destinations, mapped once for every rank that plans from it: the
    per-expert tensors a fused parameter merges, by their global expert index (a rank visits only its own);
    each entry (position in the checkpoint, shard, tensor, quantized part or None, target)."""

    common: list[tuple]
    per_expert: dict[int, list[tuple]]
    expert_params: set[str]  # the fused parameters the per-expert tensors fill
    unexpected: list[str]  # checkpoint tensors the model has no place for (ignored, as transformers does)
    metadata: list[str]  # quantization metadata the shapes already imply


def map_checkpoint(shards: dict[str, dict[str, TensorInfo]], mapper: NameMapper,
                   quantization: Quantization | None = None) -> MappedCheckpoint:
    """Every checkpoint tensor's destination (`quantization`: the checkpoint's format, its parameters' parts)."""
    mapped = MappedCheckpoint([], defaultdict(list), set(), [], [])
    position = 0
    for shard, tensors in shards.items():
        for info in tensors.values():
            part = _quantized_part(quantization, info)
            target = mapper.target(part.param_key if part else info.name)
            if target is None:
                mapped.unexpected.append(info.name)
            elif part is not None and part.part is None and target.conversion is None:
                mapped.metadata.append(info.name)
            elif target.expert is not None and target.conversion is None:
                mapped.per_expert[target.expert].append((position, shard, info, part, target))
                mapped.expert_params.add(target.param)
            else:
                mapped.common.append((position, shard, info, part, target))
            position += 1
    _refuse_quantized_leftovers(mapped.unexpected, quantization)
    return mapped


def _entries(mapped: MappedCheckpoint, experts: dict[str, ExpertPlacement], aliases: dict[str, str]):
    """The mapped tensors this rank may read, in checkpoint order: all but the per-expert tensors of experts
    outside its share (all of them where some fused parameter they fill is not shared out)."""
    shares = [experts.get(aliases.get(param, param)) for param in mapped.expert_params]
    ranges = {None if share is None else (share.first, share.count) for share in shares}
    if len(ranges) == 1 and None not in ranges:
        first, count = ranges.pop()
        wanted = range(first, first + count)
    else:
        wanted = mapped.per_expert.keys()
    chosen = mapped.common + [entry for e in wanted for entry in mapped.per_expert.get(e, ())]
    return sorted(chosen, key=lambda entry: entry[0])


def plan_mapped(mapped: MappedCheckpoint, shapes: dict[str, tuple[int, ...]], required: set[str],
                experts: dict[str, ExpertPlacement], aliases: dict[str, str], digests: dict | None,
                quantization: Quantization | None = None, held: set[str] | None = None) -> Plan:
    """`shapes`: the allocated shape of every parameter/buffer that may be filled (expert parameters hold only
    this rank's share, `experts` says which); `required`: those the checkpoint must cover (the parameters);
    `aliases` maps tied names to the one allocated; `digests`: the manifest's per-tensor checksums;
    `quantization`: the checkpoint's format (its parameters' parts are planned into storage tensors); `held`: the
    parameters and buffers this rank holds (a pipeline stage's), None: all; the others' tensors are not read."""
    raw, quantized = [], defaultdict(set)
    staged, conversions = {}, {}
    for _, shard, info, part, target in _entries(mapped, experts, aliases):
        param = aliases.get(target.param, target.param)
        filled = target.conversion.targets if target.conversion is not None else (param,)
        if held is not None and not any(aliases.get(t, t) in held for t in filled):
            continue
        digest = (digests or {}).get(info.name, {})
        share = experts.get(param)
        if target.conversion is not None:
            conv = target.conversion
            if part is not None or any(t in experts for t in conv.targets):
                raise WeightsError(f"tensor {info.name}: conversion {conv.converter.operations} of a quantized "
                                   "or expert-parallel tensor is not supported by the streaming loader")
            stage = f"{info.name}{STAGED}"
            staged[stage] = (info.shape, info.dtype)
            conversions.setdefault(conv.layer, (conv, []))[1].append((info.name, stage))
            raw.append((shard, info, stage, target, None, tensor_checksum(digest), info.shape))
            continue
        if part is not None:
            quantized[param].add(part.part)
            param = storage_name(param, part.part)
        if target.expert is not None:  # a per-expert tensor merged into a fused parameter
            if share is None:
                raw.append((shard, info, param, target, target.expert, tensor_checksum(digest), info.shape))
            elif share.first <= target.expert < share.first + share.count:
                raw.append((shard, info, param, target, target.expert - share.first, tensor_checksum(digest),
                            info.shape))
        elif share is not None and share.count < share.num_experts and info.shape[:1] == (share.num_experts,):
            raw.extend(_expert_slices(shard, info, param, target, share, digest))
        else:
            raw.append((shard, info, param, target, None, tensor_checksum(digest), info.shape))
    pieces = _place(raw)
    storage = _storage(pieces, shapes, quantized, quantization)
    # a quantized parameter is covered once each of its parts' storage tensors is (every expert, every half)
    converted = {t for conv, _ in conversions.values() for t in conv.targets}
    _check(pieces, {**shapes, **{name: shape for name, (shape, _) in {**storage, **staged}.items()}},
           (required - set(quantized) - converted) | set(storage) | set(staged), experts)
    return Plan(pieces, list(mapped.unexpected), storage, list(mapped.metadata), staged, conversions)


def _quantized_part(quantization: Quantization | None, info: TensorInfo) -> Part | None:
    if quantization is not None:
        return split(quantization, info.name, info.dtype)
    if info.dtype.startswith("F8"):  # read as values, FP8 codes would be off by their block scales
        raise WeightsError(f"tensor {info.name} is {info.dtype} but config.json has no quantization_config: "
                           "an FP8 checkpoint needs its quantization_config (quant_method fp8 and block scales)")
    return None


def _refuse_quantized_leftovers(unexpected: list[str], quantization: Quantization | None) -> None:
    """A scale, zero point or packed weight nothing reads would leave its weight silently wrong."""
    leftovers = [name for name in unexpected if name.endswith(QUANTIZED_SUFFIXES)]
    if leftovers:
        what = f"a {quantization.format} checkpoint" if quantization else "config.json has no quantization_config"
        raise WeightsError(f"quantization tensors that no weight of this model reads ({what}): "
                           f"{tensor_list(leftovers)}")


def _storage(pieces: list[Piece], shapes: dict[str, tuple[int, ...]], quantized: dict[str, set[str]],
             quantization: Quantization | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shape and dtype of every part's storage tensor, from its pieces: expert slices lead with the parameter's
    (local) expert count, concatenated pieces add up along their dim."""
    missing = [f"{param} ({', '.join(sorted(required_parts(quantization) - parts))})"
               for param, parts in quantized.items() if required_parts(quantization) - parts]
    if missing:
        raise WeightsError(f"quantized weights without all their parts: {tensor_list(missing)}")
    storage = {}
    for name, group in _by_param(pieces).items():
        if (parsed := parse_storage_name(name)) is None:
            continue
        param, first = parsed[0], group[0]
        shape = list(first.shape)
        if first.dim is not None:
            shape[first.dim] = max(p.offset + p.shape[p.dim] for p in group)
        lead = [shapes[param][0]] if first.index is not None else []
        storage[name] = (tuple(lead + shape), first.dtype)
    return storage


def _by_param(pieces: list[Piece]) -> dict[str, list[Piece]]:
    groups = defaultdict(list)
    for p in pieces:
        groups[p.param].append(p)
    return groups


def _expert_slices(shard, info: TensorInfo, param, target, share: ExpertPlacement, digest):
    """This rank's rows of a fused [E, ...] checkpoint tensor: one contiguous range per local expert."""
    row = info.nbytes // share.num_experts
    slice_digests = expert_checksums(digest, share.num_experts)
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
        for shard, info, _, target, _, checksum, shape in sorted(items, key=lambda it: it[3].part):
            pieces.append(Piece(shard, info.name, info.start, info.end, info.dtype, tuple(shape), param, index,
                                dim, offset, checksum))
            offset += shape[dim] if dim is not None else 0
    return pieces


def _check(pieces: list[Piece], shapes: dict[str, tuple[int, ...]], required: set[str],
           experts: dict[str, ExpertPlacement]) -> None:
    """Every piece fits its destination exactly and every parameter is fully covered; errors list the names (and
    the experts a fused parameter lacks)."""
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
        by_param = _by_param(pieces)
        raise WeightsError("checkpoint lacks tensors for: " + tensor_list(
            _lacking(name, by_param[name], shapes[name], experts.get(_param_of(name))) for name in missing))


def _param_of(name: str) -> str:
    """The parameter a destination fills (a quantized part's storage tensor names it first)."""
    parsed = parse_storage_name(name)
    return parsed[0] if parsed else name


def _lacking(name: str, pieces: list[Piece], shape: tuple[int, ...], share: ExpertPlacement | None) -> str:
    """`name`, with the experts it has no whole tensor of when it is a fused [E, ...] parameter merged from
    per-expert checkpoint tensors (numbered as the checkpoint numbers them)."""
    per_expert = defaultdict(int)
    for p in pieces:
        if p.index is not None:
            per_expert[p.index] += math.prod(p.shape)
    first = share.first if share else 0
    lacking = [str(first + e) for e in range(shape[0]) if per_expert and per_expert[e] != math.prod(shape[1:])]
    return f"{name} (expert{'s' * (len(lacking) > 1)} {', '.join(lacking)})" if lacking else name


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
