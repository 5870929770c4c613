"""Between the control plane and a job's workers: the run spec handed to the driver, the reports the workers send
back (events, checkpoints, the result) and the control plane's answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from moetune.api.models.responses import CheckpointMetrics, ErrorInfo, EventLevel, EventType
from moetune.api.models.run_config import RunConfig


class JobRunSpec(BaseModel):
    """Everything a driver needs to run one job; handed to the Ray job as JSON."""

    job_id: str
    config: RunConfig  # the job's row holds it as made at submission
    output_uri: str  # <output_uri>/<job id>, where checkpoints and the adapter land


class EventReport(BaseModel):
    kind: Literal["event"] = "event"
    level: EventLevel = EventLevel.info
    message: str
    type: EventType = "message"
    data: dict[str, Any] | None = None


class CheckpointReport(BaseModel):
    kind: Literal["checkpoint"] = "checkpoint"
    step_number: int
    uri: str
    metrics: CheckpointMetrics
    # Older checkpoints this one replaces (training.keep_checkpoints): no longer listed once the report is
    # accepted; the workers delete them from storage after that.
    retired_steps: list[int] = Field(default_factory=list)

    @field_validator("retired_steps")
    @classmethod
    def _retires_only_older(cls, steps: list[int], info: ValidationInfo) -> list[int]:
        if any(step >= info.data.get("step_number", 0) for step in steps):
            raise ValueError("must be older than step_number")
        return steps


class ResultReport(BaseModel):
    """The driver's final word. `fine_tuned_model` is the adapter URI on success."""

    kind: Literal["result"] = "result"
    # "paused": the workers checkpointed and stopped because the control plane asked them to (ReportAck).
    status: Literal["succeeded", "failed", "paused"]
    fine_tuned_model: str | None = None
    result_files: list[str] = Field(default_factory=list)
    trained_tokens: int | None = None
    error: ErrorInfo | None = None


class WorkerReport(BaseModel):
    report: EventReport | CheckpointReport | ResultReport = Field(discriminator="kind")


class ReportAck(BaseModel):
    """The control plane's answer to every accepted report: `control="pause"` asks the workers to pause."""

    control: Literal["pause"] | None = None


# A job's environment variables (set by the control plane's scheduler, read by the workers): api/environment.py.
REPORT_PATH = "/internal/v1/jobs/{job_id}/reports"
# What a job leaves under JobRunSpec.output_uri (adapter, metrics, summary, checkpoints): see api/layout.py.
# Error codes (ErrorInfo.code): see api/errors.py.
