"""Stored rows -> the wire objects of api.models (and the id formats clients see)."""

from __future__ import annotations

from moetune.api.model_names import fine_tuned_name
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import RunConfig
from moetune.api.models.training import TrainingSpec
from moetune.api.models.responses import Checkpoint, CheckpointMetrics, ErrorInfo, Job, JobEvent, Progress
from moetune.api.preference import method_view
from moetune.service.base_models import BaseModels

EVENT_ID_PREFIX = "ftevent-"
CHECKPOINT_ID_PREFIX = "ftckpt-"
_BASE_LEARNING_RATE = TrainingSpec.model_fields["learning_rate"].default


def event_id(seq: int) -> str:
    return f"{EVENT_ID_PREFIX}{seq}"


def checkpoint_id(seq: int) -> str:
    return f"{CHECKPOINT_ID_PREFIX}{seq}"


def parse_sequence_id(value: str, prefix: str) -> int | None:
    """`ftevent-12` -> 12; None when `value` is not such an id."""
    number = value.removeprefix(prefix)
    return int(number) if number != value and number.isdigit() else None


def _epoch(value: float | None) -> int | None:
    return None if value is None else int(value)


def job_view(row, base_models: BaseModels) -> Job:
    spec = JobCreate.model_validate(row.spec)  # the request: what the user named
    run = RunConfig.model_validate(row.run_config)  # what runs: the values shown are these
    training = TrainingSpec.model_validate(run.request_body()["training"])
    # the stored column is the adapter's URI (the driver's report); clients address the model by its name
    name = row.fine_tuned_model and fine_tuned_name(base_models.name(spec.model), spec.suffix, row.tenant, row.id)
    # OpenAI's knobs, showing the values the job actually runs with (also under method, where OpenAI puts them).
    hyperparameters = {
        "batch_size": training.global_batch_size,
        "learning_rate_multiplier": float(f"{training.learning_rate / _BASE_LEARNING_RATE:.6g}"),
        "n_epochs": training.n_epochs if training.n_epochs is not None else "auto",
    }
    return Job(
        id=row.id,
        created_at=int(row.created_at),
        finished_at=_epoch(row.finished_at),
        model=spec.model,
        fine_tuned_model=name,
        fine_tuned_model_uri=row.fine_tuned_model,
        organization_id=row.tenant,
        status=row.status,
        error=ErrorInfo.model_validate(row.error) if row.error else None,
        hyperparameters=hyperparameters,
        method=method_view(run.method, hyperparameters),
        integrations=[i.model_dump(exclude_none=True) for i in spec.integrations or ()],
        training_file=spec.training_file,
        validation_file=spec.validation_file,
        result_files=row.result_files or [],
        trained_tokens=row.trained_tokens,
        seed=row.seed,
        estimated_finish=_epoch(row.estimated_finish),
        metadata=spec.metadata,
        user_provided_suffix=spec.suffix,
        lora=run.lora,
        training=training,
        parallelism=run.parallelism,
        output_uri=row.output_uri,
        priority=row.priority,
        progress=Progress.model_validate(row.progress or {}),
        queue_reason=row.queue_reason,
    )


def event_view(row) -> JobEvent:
    return JobEvent(id=event_id(row.seq), created_at=int(row.created_at), level=row.level, message=row.message,
                    type=row.type, data=row.data)


def checkpoint_view(row) -> Checkpoint:
    return Checkpoint(
        id=checkpoint_id(row.seq),
        created_at=int(row.created_at),
        fine_tuned_model_checkpoint=row.uri,
        fine_tuning_job_id=row.job_id,
        metrics=CheckpointMetrics.model_validate(row.metrics),
        step_number=row.step_number,
    )
