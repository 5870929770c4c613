"""The job's `evaluation` section: generation-based evaluation on a file of chat rows."""

from __future__ import annotations

from pydantic import Field, field_validator

from moetune.api.models.base import StrictModel, check_data_file
from moetune.api.models.training import EvalMetric


class EvaluationSpec(StrictModel):
    """Generation-based evaluation (workers/evaluation/generation.py): the model answers each row of `file` (chat
    rows; the reference is the row's `reference`, else its final assistant turn) at step 0 and at every `every`-th
    step (default: each checkpoint); each metric is the mean over rows, in [0, 1]. "regex": the reference is a
    regular expression the answer must contain a match of."""

    file: str = Field(..., description="An uploaded file's id (file-..., purpose evaluation) or the URI of a JSONL "
                                       "file")
    metrics: list[EvalMetric] = Field(..., min_length=1)
    every: int | None = Field(None, ge=1)
    max_new_tokens: int = Field(64, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0.0, le=2.0)

    _check_file = field_validator("file")(check_data_file)
