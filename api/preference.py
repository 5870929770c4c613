"""OpenAI's `dpo` method section: Direct Preference Optimization on rows of a preferred and a non-preferred answer
to the same prompt (the row rules are api/data_rows.py's `preference_row_problem`; the loss is
workers/methods/dpo.py's). Its `batch_size`, `learning_rate_multiplier` and `n_epochs` map onto `training` as
supervised's do (api.models.run_config.resolve_run_config); `beta` is DPO's own."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BETA = 0.1  # what "auto" means: TRL's default, the common choice in the DPO literature


class DpoHyperparameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # how far the policy may move from the reference: the scale of the log-ratio margin inside the sigmoid
    beta: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    # OpenAI's knobs shared with supervised (api.models.method.Hyperparameters), resolved onto `training` the same way
    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    n_epochs: int | Literal["auto"] = "auto"


class DpoMethod(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hyperparameters: DpoHyperparameters = Field(default_factory=DpoHyperparameters)


def dpo_beta(section: DpoMethod | None) -> float:
    beta = (section or DpoMethod()).hyperparameters.beta
    return DEFAULT_BETA if beta == "auto" else beta


def method_type(method) -> str:
    """A job's method.type (`method`: api.models.method.Method, or None for the default, supervised)."""
    return "supervised" if method is None else method.type


def sequences_per_example(method) -> int:
    """Sequences one example runs through the model: DPO's chosen and rejected run together in its micro-batch."""
    return 2 if method_type(method) == "dpo" else 1


def method_view(method, hyperparameters: dict) -> dict:
    """A job's `method` (api.models.method.Method, or None) as OpenAI shows it: its type and the knobs it runs with."""
    if method_type(method) != "dpo":
        return {"type": "supervised", "supervised": {"hyperparameters": hyperparameters}}
    return {"type": "dpo", "dpo": {"hyperparameters": {**hyperparameters, "beta": dpo_beta(method.dpo)}}}
