"""Checkpoint tensor names -> model parameters, by transformers' own conversion rules for the model's family
(renamings, per-expert tensors merged into fused [E, ...] parameters, concatenations), so that any checkpoint
transformers loads maps exactly as it would. The structural operations (merging a module list along dim 0,
concatenating) are planned as byte ranges; any other conversion (e.g. a vision tower's fused qkv chunked and
permuted for RoPE) is run by transformers' own converter on the whole source tensors once they are loaded, which
is refused only for tensors that expert parallelism shards."""

from __future__ import annotations

from dataclasses import dataclass

from moetune.workers.weights.errors import WeightsError


@dataclass(frozen=True)
class Target:
    param: str  # the model's state-dict name
    expert: int | None = None  # global expert index (a per-expert checkpoint tensor merged into [E, ...])
    concat_dim: int | None = None  # dim of the (expert) slice along which several sources are concatenated
    part: int = 0  # this source's position in that concatenation
    conversion: Conversion | None = None  # a conversion run in memory after loading (see the module docstring)


@dataclass(frozen=True)
class Conversion:
    converter: object  # transformers' WeightConverter
    layer: str  # the name transformers converts it under (its first target)
    pattern: str  # the source pattern this checkpoint tensor matched
    targets: tuple[str, ...]  # the model parameters it produces


def _numbers(key: str) -> list[int]:
    return [int(p) for p in key.split(".") if p.isdigit()]


def _expert_index(source: str, target: str) -> int:
    """The module-list index a merge removes: the first number of the source key the target does not keep."""
    src, tgt = _numbers(source), _numbers(target)
    for i, n in enumerate(src):
        if i >= len(tgt) or tgt[i] != n:
            return n
    raise WeightsError(f"tensor {source}: no expert index in its name")


class NameMapper:
    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter

        transforms = get_model_conversion_mapping(model)
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        self.prefix = model.base_model_prefix
        self.state = dict.fromkeys(model.state_dict(keep_vars=True))

    def target(self, key: str) -> Target | None:
        """Where checkpoint tensor `key` goes, or None when the model has no such tensor."""
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            apply_renamings,
            rename_source_key,
        )

        name, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.state)
        if name not in self.state and key in self.state:
            # as transformers' loader: a name some rule renames away (e.g. `.norm.` -> `.kv_norm.`, which hits
            # model.norm) keeps its own name when the model has it
            name, pattern = rename_source_key(key, [], [], self.prefix, self.state)
        if name not in self.state:
            return None
        if pattern is None:
            return Target(name)
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        ops = converter.operations
        merge = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        rest = ops[1:] if merge else ops
        concat = rest[0] if len(rest) == 1 and isinstance(rest[0], Concatenate) else None
        if len(rest) > 1 or (rest and concat is None) or (len(converter.source_patterns) > 1 and concat is None):
            if merge:  # per-expert tensors: planned per expert or not at all
                raise WeightsError(f"tensor {key}: conversion {ops} of this model family is not supported by the "
                                   "streaming loader")
            first = converter.target_patterns[0]
            targets = tuple(name.replace(first, t) for t in converter.target_patterns)
            return Target(name, conversion=Conversion(converter, name, pattern, targets))
        expert = _expert_index(apply_renamings(key, self.renamings), name) if merge else None
        dim = None if concat is None else concat.dim - (1 if merge else 0)
        return Target(name, expert, dim, converter.source_patterns.index(pattern))
