"""A fine-tuning job request (POST /v1/fine_tuning/jobs): its sections together and OpenAI's `integrations`. The
workers never see it: api.models.run_config resolves it into the job's run config.

Field names follow OpenAI's fine-tuning job objects where such a field exists; everything moetune-specific lives in
the `lora`, `training`, `parallelism` and `evaluation` sections.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from moetune.api.models.base import SpecError, StrictModel, check_data_file, check_model, check_uri
from moetune.api.models.evaluation import EvaluationSpec
from moetune.api.models.lora import LoraSpec
from moetune.api.models.method import METHOD_TYPES, Hyperparameters, Method
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.training import TrainingSpec


INTEGRATION_TYPES = ("wandb",)


class Integration(StrictModel):
    """OpenAI's `integrations` entry: stored with the job and shown on it."""

    type: str
    wandb: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, v):
        if v not in INTEGRATION_TYPES:
            raise ValueError(f"unknown integration type {v!r} (known: {', '.join(INTEGRATION_TYPES)})")
        return v


class JobCreate(StrictModel):
    model: str = Field(..., description="A registered base model's name (GET /v1/models) or the URI of a "
                                        "Hugging Face-format checkpoint folder")
    training_file: str = Field(..., description="An uploaded file's id (file-...) or the URI of a JSONL file")
    validation_file: str | None = None
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    method: Method | None = None
    integrations: list[Integration] | None = None
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    suffix: str | None = Field(None, max_length=64)
    metadata: dict[str, str] | None = None
    lora: LoraSpec = Field(default_factory=LoraSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    parallelism: ParallelDims = Field(default_factory=ParallelDims)
    evaluation: EvaluationSpec | None = None
    output_uri: str | None = Field(None, description="where checkpoints and the adapter go (default: server setting)")
    priority: int = Field(0, ge=-100, le=100)

    _check_uris = field_validator("output_uri")(check_uri)
    _check_data_files = field_validator("training_file", "validation_file")(check_data_file)
    _check_model_name = field_validator("model")(check_model)

    @model_validator(mode="after")
    def _selected_checkpoint_is_evaluated(self):
        selected = self.training.select_checkpoint
        if selected.startswith("best:"):
            metric = selected.removeprefix("best:")
            if self.evaluation is None or metric not in self.evaluation.metrics:
                raise ValueError(f"training.select_checkpoint {selected!r} needs evaluation.metrics to include "
                                 f"{metric!r}")
            if not self.training.checkpoint_every:
                raise ValueError(f"training.select_checkpoint {selected!r} needs training.checkpoint_every")
        return self

    @field_validator("suffix")
    @classmethod
    def _suffix_chars(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
            raise ValueError("may only contain letters, digits, '-', '_' and '.'")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, v):
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("at most 16 pairs, keys up to 64 and values up to 512 characters")
        return v


def method_hyperparameters(req: JobCreate) -> Hyperparameters:
    """The OpenAI knobs: the method section's `hyperparameters` (OpenAI's current place) over the top-level ones;
    a SpecError for a method type or section that does not apply."""
    method = req.method
    if method is None:
        return req.hyperparameters
    if method.type not in METHOD_TYPES:
        raise SpecError("method.type", f"method.type: {method.type!r} is not supported yet (supported: "
                                       f"{', '.join(METHOD_TYPES)})")
    for other in (t for t in (*METHOD_TYPES, "reinforcement") if t != method.type):
        if getattr(method, other) is not None:  # whose knobs would apply is a guess: say so
            raise SpecError(f"method.{other}", f"method.{other} is given but method.type is {method.type!r}")
    section = getattr(method, method.type)
    if section is None:
        return req.hyperparameters
    given = section.hyperparameters.model_dump(exclude_unset=True, include=set(Hyperparameters.model_fields))
    return req.hyperparameters.model_copy(update=given)
