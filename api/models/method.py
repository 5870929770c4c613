"""OpenAI's `hyperparameters` and `method` sections (supervised or DPO, api/preference.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from moetune.api.models.base import StrictModel
from moetune.api.preference import DpoMethod


class Hyperparameters(StrictModel):
    """OpenAI-compatible knobs; when given they override the matching `training` fields."""

    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    n_epochs: int | Literal["auto"] = "auto"


class SupervisedMethod(StrictModel):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


METHOD_TYPES = ("supervised", "dpo")


class Method(StrictModel):
    """OpenAI's `method`: "supervised" or "dpo" (api/preference.py); other types are refused by resolve_run_config with
    the field named (a typed Literal would answer with pydantic's generic message instead)."""

    type: str = "supervised"
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    # OpenAI's other method section, accepted in shape so the refusal names the type, not an extra field.
    reinforcement: dict[str, Any] | None = None
