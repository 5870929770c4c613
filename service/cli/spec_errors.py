"""A job file's validation errors in the user's terms: each field's path and pydantic's message without its
documentation URL, and for an unknown field the known one it most likely meant."""

from __future__ import annotations

import difflib
from typing import get_args

from pydantic import BaseModel, ValidationError


def explain(where: str, error: ValidationError, model: type[BaseModel]) -> str:
    """`where: problem`, or `where:` and a problem a line."""
    problems = [_one(e, model) for e in error.errors()]
    return f"{where}: {problems[0]}" if len(problems) == 1 else "\n  ".join([f"{where}:", *problems])


def _one(error, model: type[BaseModel]) -> str:
    loc = tuple(error["loc"])
    path = ".".join(str(part) for part in loc) or "the file"
    if error["type"] != "extra_forbidden":
        return f"{path}: {error['msg']}"
    known = _fields_at(model, loc[:-1])
    guess = difflib.get_close_matches(str(loc[-1]), known, n=1)
    if guess:
        return f"{path}: unknown field; did you mean {'.'.join([*map(str, loc[:-1]), guess[0]])}?"
    return f"{path}: unknown field" + (f"; the fields there: {', '.join(known)}" if known else "")


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names (as a file writes them) of the object at `loc`: list indexes, dict keys and union tags in
    it name no field and are passed over."""
    models = [model]
    for part in loc:
        inner = [found for m in models if (field := _field(m, part)) is not None
                 for found in _models_in(field.annotation)]
        models = inner or models
    return sorted({field.alias or name for m in models for name, field in m.model_fields.items()})


def _field(model: type[BaseModel], name):
    return next((field for key, field in model.model_fields.items() if name in (key, field.alias)), None)


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [found for arg in get_args(annotation) for found in _models_in(arg)]
