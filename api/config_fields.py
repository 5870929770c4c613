"""Reading a checkpoint's config.json (torch-free): each field moetune reads is checked for its JSON type where it is
read, so a malformed one is a SpecError (param `model`: a 422 at submission) naming the field, never a traceback
further on."""

from __future__ import annotations

from typing import Any

from moetune.api.models.base import SpecError

_KINDS = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


def config_error(field: str, problem: str) -> SpecError:
    return SpecError("model", f"model: config.json field '{field}' {problem}")


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{_KINDS.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def checked(value: Any, kind: type, field: str) -> Any:
    """`value` when it is a `kind` (an int is no bool) or None; a SpecError naming the field otherwise."""
    if value is not None and (not isinstance(value, kind) or kind is int and isinstance(value, bool)):
        raise config_error(field, f"must be {_KINDS[kind]}, not {_shown(value)}")
    return value


def read(config: dict, key: str, kind: type, where: str = "") -> Any:
    """`config[key]` when it is a `kind`, None when absent or null; a SpecError naming the field (`where.key`)
    otherwise."""
    return checked(config.get(key), kind, f"{where}.{key}" if where else key)


def read_positive_ints(config: dict, key: str, where: str = "", length: int | None = None) -> list[int] | None:
    """A list of positive integers (of `length` items when given), None when absent."""
    value = read(config, key, list, where)
    if value is not None and (any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in value)
                              or length is not None and len(value) != length):
        count = f"{length} " if length else ""
        raise config_error(f"{where}.{key}" if where else key, f"must be a list of {count}positive integers, not "
                                                               f"{_shown(value)}")
    return value
