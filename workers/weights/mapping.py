"""Checkpoint tensor names -> model parameters, by transformers' own conversion rules for the model's family
(renamings, per-expert tensors merged into fused [E, ...] parameters, concatenations), so that any checkpoint
transformers loads maps exactly as it would. The structural operations (merging a module list along dim 0,
concatenating) are planned as byte ranges; any other conversion (e.g. a vision tower's fused qkv chunked and
permuted for RoPE) is run by transformers' own converter on the whole source tensors once they are loaded, which
is refused only for tensors that expert parallelism shards."""

from __future__ import annotations

import re
from dataclasses import dataclass

from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    apply_converters,
    apply_renamings,
    rename_source_key,
)

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


# A source pattern that can tell one number from another: a literal number as a name component (`proj.2`), a
# digit count (`\d` alone, `{2}`), a digit in a character class, a backreference.
_NUMBER_SPECIFIC = re.compile(r"(?:^|[.^(|]|\\\.)\d|\\d(?![+*])|\{\d|\[[^\]]*\d|\\[1-9]")
_STAND_IN = 7_000_000_000  # numbers no checkpoint key holds, standing in for a key's numeric name components


class _Renamer:
    """transformers' renamings, then at most one of its converters, of a checkpoint key: (after the renamings,
    after the converter, the converter's source pattern or None). Each rule is a regular expression searched over
    the whole key: 15 µs a key with Kimi K3's rules, 7.6 s for its 494,592 per-expert release tensors (six per
    routed expert), on every rank at every start.
    Keys that differ only in their numeric name components (layer, expert) rename alike when no rule names a
    specific number, so each such shape of key is renamed once with stand-in numbers and the key's own numbers
    are put back; checked against transformers' own renaming on the shape's first key. A family with a rule that
    names a number renames every key through transformers."""

    def __init__(self, renamings: list, converters: list):
        self.renamings, self.converters = renamings, converters
        patterns = [p for rule in (*renamings, *converters) for p in rule.source_patterns]
        self.shapes = None if any(_NUMBER_SPECIFIC.search(p) for p in patterns) else {}

    def _rename(self, key: str) -> tuple[str, str, str | None]:
        renamed = apply_renamings(key, self.renamings)
        return renamed, *apply_converters(renamed, self.converters)

    def __call__(self, key: str) -> tuple[str, str, str | None]:
        parts = key.split(".")
        numbers = [p for p in parts if p.isdigit()]
        if self.shapes is None or not numbers:
            return self._rename(key)
        shape = tuple(None if p.isdigit() else p for p in parts)
        stand_ins = [str(_STAND_IN + i) for i in range(len(numbers))]
        known = self.shapes.get(shape)
        if known is None:
            numbered = iter(stand_ins)
            known = self._rename(".".join(next(numbered) if p.isdigit() else p for p in parts))
            real = self._rename(key)
            self.shapes[shape] = known if _put_back(known, stand_ins, numbers) == real else False
            return real
        return _put_back(known, stand_ins, numbers) if known else self._rename(key)


def _put_back(renamed: tuple[str, str, str | None], stand_ins: list[str], numbers: list[str]):
    before, after, pattern = renamed
    for stand_in, number in zip(stand_ins, numbers):
        before, after = before.replace(stand_in, number), after.replace(stand_in, number)
    return before, after, pattern


class NameMapper:
    def __init__(self, model):
        from transformers.conversion_mapping import get_model_conversion_mapping

        transforms = get_model_conversion_mapping(model)
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.renamer = _Renamer([t for t in transforms if not isinstance(t, WeightConverter)], self.converters)
        self.prefix = model.base_model_prefix
        self.state = dict.fromkeys(model.state_dict(keep_vars=True))
        self.rules = {}  # source pattern -> _rule's answer

    def target(self, key: str) -> Target | None:
        """Where checkpoint tensor `key` goes, or None when the model has no such tensor."""
        renamed, converted, pattern = self.renamer(key)
        # transformers' rename_source_key with no rules left: only its base-model-prefix step
        name, _ = rename_source_key(converted, [], [], self.prefix, self.state)
        if name not in self.state and key in self.state:
            # as transformers' loader: a name some rule renames away (e.g. `.norm.` -> `.kv_norm.`, which hits
            # model.norm) keeps its own name when the model has it
            name, pattern = rename_source_key(key, [], [], self.prefix, self.state)
        if name not in self.state:
            return None
        if pattern is None:
            return Target(name)
        converter, merge, dim, part = self._rule(pattern)
        if part is None:  # not byte ranges: converted in memory
            if merge:  # per-expert tensors: planned per expert or not at all
                raise WeightsError(f"tensor {key}: conversion {converter.operations} of this model family is not "
                                   "supported by the streaming loader")
            first = converter.target_patterns[0]
            targets = tuple(name.replace(first, t) for t in converter.target_patterns)
            return Target(name, conversion=Conversion(converter, name, pattern, targets))
        return Target(name, _expert_index(renamed, name) if merge else None, dim, part)

    def _rule(self, pattern: str) -> tuple[object, bool, int | None, int | None]:
        """What the converter of source `pattern` does, as byte ranges: (the converter, whether it merges
        per-expert tensors along dim 0, the dim of the slice its sources are concatenated along or None, this
        source's position among them; None where byte ranges cannot plan it)."""
        if pattern not in self.rules:
            converter = next(c for c in self.converters if pattern in c.source_patterns)
            ops = converter.operations
            merge = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            rest = ops[1:] if merge else ops
            concat = rest[0] if len(rest) == 1 and isinstance(rest[0], Concatenate) else None
            ranges = not (len(rest) > 1 or (rest and concat is None)
                          or (len(converter.source_patterns) > 1 and concat is None))
            dim = None if concat is None else concat.dim - (1 if merge else 0)
            self.rules[pattern] = (converter, merge, dim, converter.source_patterns.index(pattern) if ranges else None)
        return self.rules[pattern]
