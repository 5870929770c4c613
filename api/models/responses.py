"""What the public routes answer: jobs and their status, events, checkpoints, files, list pages and errors."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.training import TrainingSpec


class JobStatus(StrEnum):
    validating_files = "validating_files"
    queued = "queued"
    running = "running"
    # pause: a running job is `pausing` until its workers checkpoint and stop, then `paused` (not terminal:
    # resume puts it back in the queue and it continues from that checkpoint).
    pausing = "pausing"
    paused = "paused"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class ErrorInfo(BaseModel):
    code: str  # one of api.errors.ErrorCode (a plain string on the wire)
    message: str
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Progress(BaseModel):
    step: int = 0
    total_steps: int | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    tokens_per_second: float | None = None


class Job(BaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    finished_at: int | None = None
    model: str
    # `ft:<base>:<suffix or tenant>:<job id>` once the job succeeded (api/model_names.py); the adapter's storage
    # location is fine_tuned_model_uri
    fine_tuned_model: str | None = None
    fine_tuned_model_uri: str | None = None
    organization_id: str
    status: JobStatus
    error: ErrorInfo | None = None
    hyperparameters: dict[str, Any]
    method: dict[str, Any] = Field(default_factory=lambda: {"type": "supervised"})
    training_file: str
    validation_file: str | None = None
    result_files: list[str] = Field(default_factory=list)
    trained_tokens: int | None = None
    seed: int
    estimated_finish: int | None = None
    integrations: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    user_provided_suffix: str | None = None
    # moetune extensions
    lora: LoraSpec
    training: TrainingSpec
    parallelism: ParallelDims
    output_uri: str
    priority: int = 0
    progress: Progress = Field(default_factory=Progress)
    # Why a validating or queued job has not moved on yet (storage or Ray unreachable, cluster busy, no free slot).
    queue_reason: str | None = None


class EventLevel(StrEnum):
    """A job event's level (OpenAI's three). Senders name a member (`EventLevel.warn`) instead of spelling the
    string: a level the wire does not allow was once found only when a running job's report failed validation."""

    info = "info"
    warn = "warn"
    error = "error"


EventType = Literal["message", "metrics"]


class JobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: EventLevel = EventLevel.info
    message: str
    type: EventType = "message"
    data: dict[str, Any] | None = None


class CheckpointMetrics(BaseModel):
    model_config = ConfigDict(extra="allow")
    step: int
    train_loss: float | None = None
    valid_loss: float | None = None


class Checkpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    metrics: CheckpointMetrics
    step_number: int


# "fine-tune": training or validation rows (OpenAI's purpose); "evaluation": moetune's evaluation.file rows
FilePurpose = Literal["fine-tune", "evaluation"]


class FileObject(BaseModel):
    """An uploaded data file (OpenAI's file object); its rows were checked on upload."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["processed"] = "processed"
    rows: int  # moetune: how many rows the upload check read


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


T = TypeVar("T")


class ListPage(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
