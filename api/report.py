"""The adaptation report of a job (`<output>/<job>/report/report.json`, GET /v1/fine_tuning/jobs/{id}/report): what
was trained with what (spec, versions, LoRA coverage, the precision alignment), how it went step by step (losses,
throughput and its time split, memory per rank, expert-load imbalance per layer), its checkpoints and resumes, and
how to run it again. The published JSON schema is docs/adaptation_report.schema.json (this model's)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

REPORT_SCHEMA_VERSION = 1
EVAL_PREFIX = "eval_"  # an evaluation score's key in a step record, a checkpoint's metrics and metrics.jsonl


class _Report(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AlignmentRow(_Report):
    """One swapped operator (rmse_ratio against its reference) or the first loss (loss, reference_loss,
    relative_diff), within `tolerance` when ok."""

    op: str
    tolerance: float
    ok: bool
    rmse_ratio: float | None = None
    loss: float | None = None
    reference_loss: float | None = None
    relative_diff: float | None = None


class StepRecord(_Report):
    """One optimizer step as the workers logged it (metrics.jsonl); other figures a step carries are kept
    (evaluation scores as `eval_<metric>`)."""

    model_config = ConfigDict(extra="allow")

    step: int
    total_steps: int
    train_loss: float
    learning_rate: float
    tokens_per_second: float
    trained_tokens: int
    valid_loss: float | None = None
    train_seconds: float | None = None  # forward, backward and optimizer of every micro-batch
    eval_seconds: float | None = None  # the validation pass, when the step had one
    alltoall_share: float | None = None  # the slowest rank's token all-to-all seconds over train_seconds
    context_share: float | None = None  # the slowest rank's context-parallel exchange seconds over train_seconds
    # pipeline stages, a value per stage (its ranks' mean): the share and seconds of its schedule outside its
    # forwards, backwards and loss (the bubble, sends and receives), the MB it sent and received
    pipeline_idle_share: list[float] | None = None
    pipeline_idle_seconds: list[float] | None = None
    pipeline_sent_mb: list[float] | None = None
    pipeline_received_mb: list[float] | None = None
    memory_peak_mb: list[float] | None = None  # per rank
    memory_budget_mb: float | None = None
    expert_imbalance: dict[str, float] | None = None  # MoE layer -> max / mean expert load of the step
    checkpoint: str | None = None  # the checkpoint written after this step
    resumed_from_step: int | None = None  # the run resumed from that checkpoint just before this step


class CheckpointEntry(_Report):
    step: int
    name: str
    kept: bool  # still in storage (keep_checkpoints retires older ones)
    train_loss: float | None = None
    valid_loss: float | None = None


class Throughput(_Report):
    tokens_per_second: float  # mean over steps
    step_seconds: float  # mean time of a step's training part
    eval_share: float  # evaluation time over all step time
    alltoall_share: float  # token all-to-all time over training time (0 without expert parallelism)
    context_share: float | None = None  # context-parallel exchange time over training time (None without CP)
    # per pipeline stage (None without stages): its time outside its forwards, backwards and loss over training
    # time, and the MB it sent a step (mean over steps)
    pipeline_idle_share: list[float] | None = None
    pipeline_sent_mb: list[float] | None = None


class Memory(_Report):
    peak_mb_per_rank: list[float]
    budget_mb: float | None


class ExpertImbalance(_Report):
    """The heatmap: ratio[i][j] is layer layers[i]'s max / mean expert load at step steps[j]."""

    layers: list[str]
    steps: list[int]
    ratio: list[list[float]]


class Evaluation(_Report):
    """Generation-based evaluation: each metric's score at step 0 (the base model; None when a resumed run did not
    evaluate it) and at each evaluated step (scores[metric][i] at steps[i])."""

    metrics: list[str]
    base: dict[str, float] | None
    steps: list[int]
    scores: dict[str, list[float]]


class Reproduce(_Report):
    """The exact job body (POST /v1/fine_tuning/jobs) and the seed it ran with."""

    job: dict[str, Any]
    seed: int


class AdaptationReport(_Report):
    schema_version: Literal[1] = REPORT_SCHEMA_VERSION
    job_id: str
    model: str
    created_at: float  # when the report was written (Unix seconds)
    versions: dict[str, str | None]  # moetune, torch, transformers, deepspeed, peft, triton, kernel backend, git
    alignment: list[AlignmentRow] | None  # None: not checked (alignment_check false, or a resumed run)
    lora_coverage: list[dict[str, Any]]  # per layer type (workers.lora.coverage rows)
    steps: list[StepRecord]
    throughput: Throughput
    memory: Memory
    expert_imbalance: ExpertImbalance | None  # None without routed-expert layers
    checkpoints: list[CheckpointEntry]
    evaluation: Evaluation | None  # None without an `evaluation` section
    selected_step: int | None  # the step whose state is the exported adapter (training.select_checkpoint)
    resumes: list[int]  # the steps runs resumed from
    first_train_loss: float
    last_train_loss: float
    last_valid_loss: float | None
    reproduce: Reproduce
