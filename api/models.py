"""The wire contract shared by the control plane, the workers and the SDK.

Field names follow OpenAI's fine-tuning job objects where such a field exists; everything
moetune-specific lives in the `lora`, `training` and `parallelism` sections.
"""

from __future__ import annotations

import math
import re
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from moetune.api.preference import DpoMethod

# memory:// is deliberately absent: it lives in one process and Ray workers are others.
URI_SCHEMES = ("s3://", "file://")


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


class _Strict(BaseModel):
    # Unknown fields are a user error (a typo like `learning_rat` must not be silently ignored).
    model_config = ConfigDict(extra="forbid")


def _check_uri(value: str | None) -> str | None:
    # The form only (and never the web): which storage schemes a tenant may use is the server's decision
    # (api.uri_access: file:// only where the operator enables it).
    if value is not None and ("://" not in value or value.startswith(("http://", "https://"))):
        raise ValueError("must be an object-storage URI such as s3://bucket/path")
    return value


FILE_ID_PREFIX = "file-"  # an uploaded file (POST /v1/files), usable wherever a job takes a data file's URI


def _check_data_file(value: str | None) -> str | None:
    if value is not None and not value.startswith(FILE_ID_PREFIX):
        try:
            _check_uri(value)
        except ValueError:
            raise ValueError(f"must be an uploaded file's id ({FILE_ID_PREFIX}...) or an object-storage URI such "
                             f"as s3://bucket/file.jsonl") from None
    return value


def _check_model(value: str) -> str:
    if "://" in value:
        return _check_uri(value)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise ValueError("must be a registered base model's name (GET /v1/models) or a URI such as "
                         "s3://bucket/models/name")
    return value


class LoraSpec(_Strict):
    rank: int = Field(16, ge=1, le=1024)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    # A preset, resolved per layer type of the model (workers/lora/coverage.py): "all-linear" (every linear but
    # lm_head and the router), "attention" (linear, full and sparse attention), "mlp" (dense MLPs and shared
    # experts), "experts" (shared and routed experts: sets train_experts); or explicit module names (matched as in
    # PEFT: exact or suffix).
    target_modules: Literal["all-linear", "attention", "mlp", "experts"] | list[str] = "all-linear"
    # Per-expert low-rank adapters on the routed experts (see the expert-parallel engine).
    train_experts: bool = False
    # A model with a vision tower: LoRA on none of it (frozen, the default), its projector only, or all of it.
    vision: Literal["none", "projector", "all"] = "none"

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(not name.strip() for name in v)):
            raise ValueError("must be a preset ('all-linear', 'attention', 'mlp', 'experts') or a non-empty list "
                             "of module names")
        return v

    @model_validator(mode="after")
    def _experts_preset(self):
        if self.target_modules == "experts":
            self.train_experts = True  # the preset's point: the routed experts
        return self


class SeqLenStage(_Strict):
    """One stage of a staged context length: `seq_len` until optimizer step `until_step` (inclusive) or until that
    fraction `until` of training; the last stage has neither and runs to the end."""

    seq_len: int = Field(..., ge=8, le=1_048_576)
    until_step: int | None = Field(None, ge=1)
    until: float | None = Field(None, gt=0.0, lt=1.0)

    @model_validator(mode="after")
    def _one_end(self):
        if self.until_step is not None and self.until is not None:
            raise ValueError("set either until_step or until (a fraction of training), not both")
        return self


EvalMetric = Literal["exact_match", "contains", "regex", "token_f1", "rouge_l", "chrf"]
EVAL_METRICS = get_args(EvalMetric)


class TrainingSpec(_Strict):
    max_steps: int | None = Field(None, ge=1)
    # max_steps x global_batch_size over more passes of the training file than the server's MOETUNE_MAX_EPOCHS is
    # refused at submission (a typo like 10**12 steps), unless this says it is meant.
    allow_many_epochs: bool = False
    n_epochs: int | None = Field(None, ge=1, le=1000)
    learning_rate: float = Field(1e-4, gt=0, le=1.0)
    warmup_ratio: float = Field(0.03, ge=0.0, le=1.0)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    global_batch_size: int = Field(8, ge=1)
    # "auto": the online tuner picks it from measured memory headroom (workers/loop/tuner.py).
    micro_batch_size: int | Literal["auto"] = 1
    # Memory one worker may use, in MB (10^6 bytes), for micro_batch_size "auto". GPU: peak allocated device
    # memory (default 90% of the device); CPU: activation bytes saved for backward (default: no limit).
    memory_budget_mb: float | None = Field(None, gt=0)
    seq_len: int = Field(512, ge=8, le=1_048_576)  # with seq_len_schedule: its longest stage (set from it)
    # Staged context length, shortest first, e.g. [{"until_step": 200, "seq_len": 8192}, {"seq_len": 131072}].
    seq_len_schedule: list[SeqLenStage] | None = Field(None, min_length=1)
    # Recompute each decoder layer in the backward instead of keeping its activations; "auto": when the memory plan
    # says the job does not fit without it.
    activation_checkpointing: bool | Literal["auto"] = "auto"
    eval_every: int | None = Field(None, ge=1)
    checkpoint_every: int | None = Field(None, ge=1)
    # Keep only the newest N complete checkpoints (older ones are deleted from storage and the list); None: all.
    keep_checkpoints: int | None = Field(None, ge=1)
    # moetune's kernels (kernels/) replace the family's attention cores; False keeps transformers' own code.
    custom_kernels: bool = True
    # A quantized checkpoint's frozen weights (FP8 block, INT4 pack-quantized) stay in their stored format and are
    # dequantized a tile at a time inside the compute; "dequantized" expands them once at load instead.
    base_weights: Literal["quantized", "dequantized"] = "quantized"
    # Before step 1, each swapped operator and the first loss are compared with their references on the job's first
    # micro-batch (workers/evaluation/alignment.py): true fails the job beyond tolerance, "warn" only warns.
    alignment_check: bool | Literal["warn"] = True
    # The checkpoint exported as the job's adapter: the last step's, or the one with the best evaluation metric
    # ("best:<metric>", one of evaluation.metrics; higher is better, the earliest wins a tie).
    select_checkpoint: str = Field("last", pattern=r"^(last|best:(" + "|".join(EVAL_METRICS) + r"))$")

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch(cls, v):
        if v != "auto" and v < 1:
            raise ValueError("must be >= 1 or \"auto\"")
        return v

    @model_validator(mode="after")
    def _steps_or_epochs(self):
        if self.max_steps is not None and self.n_epochs is not None:
            raise ValueError("set either max_steps or n_epochs, not both")
        return self

    @model_validator(mode="after")
    def _schedule(self):
        stages = self.seq_len_schedule
        if not stages:
            return self
        *early, last = stages
        if last.until_step is not None or last.until is not None:
            raise ValueError("seq_len_schedule: the last stage runs to the end (no until_step / until)")
        if any(s.until_step is None and s.until is None for s in early):
            raise ValueError("seq_len_schedule: every stage but the last needs until_step or until")
        lengths = [s.seq_len for s in stages]
        if lengths != sorted(lengths):
            raise ValueError("seq_len_schedule: seq_len must not shrink from one stage to the next")
        for kind in ("until_step", "until"):
            ends = [getattr(s, kind) for s in early if getattr(s, kind) is not None]
            if ends != sorted(set(ends)):
                raise ValueError(f"seq_len_schedule: {kind} must increase from one stage to the next")
        self.seq_len = last.seq_len
        return self

    def seq_len_at(self, step: int, total_steps: int) -> int:
        """The context length of optimizer step `step` (1-based) of `total_steps`."""
        for stage in self.seq_len_schedule or ():
            end = stage.until_step if stage.until is None else math.ceil(stage.until * total_steps)
            if end is None or step <= end:
                return stage.seq_len
        return self.seq_len


class ParallelismSpec(_Strict):
    num_workers: int = Field(1, ge=1, le=4096)
    gpus_per_worker: int = Field(0, ge=0, le=16)  # 0 = CPU workers (gloo)
    expert_parallel_size: int = Field(1, ge=1)
    zero_stage: Literal[1, 2, 3] = 2

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources of one training worker (its placement bundle): the driver asks Ray Train for these,
        the scheduler checks the cluster has them before it submits."""
        return {"CPU": 1, "GPU": self.gpus_per_worker} if self.gpus_per_worker else {"CPU": 1}

    @property
    def collective_forward(self) -> bool:
        """Whether a forward itself runs collectives (expert all-to-all, ZeRO-3 parameter gathers): every rank must
        then run each forward with its peers."""
        return self.expert_parallel_size > 1 or self.zero_stage == 3

    def check_expert_split(self, routed_experts: int | None = None) -> None:
        """The control plane's one check that EP divides the workers and the routed experts (`routed_experts`, once
        the model's config.json is read); the workers' one is workers.experts.placement.ExpertPlacement."""
        if self.num_workers % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size", "must divide parallelism.num_workers")
        if routed_experts is not None and routed_experts % self.expert_parallel_size:
            raise SpecError("parallelism.expert_parallel_size", f"must divide the model's {routed_experts} routed "
                                                                f"experts (got {self.expert_parallel_size})")


class Hyperparameters(_Strict):
    """OpenAI-compatible knobs; when given they override the matching `training` fields."""

    batch_size: int | Literal["auto"] = "auto"
    learning_rate_multiplier: float | Literal["auto"] = "auto"
    n_epochs: int | Literal["auto"] = "auto"


class SupervisedMethod(_Strict):
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)


METHOD_TYPES = ("supervised", "dpo")


class Method(_Strict):
    """OpenAI's `method`: "supervised" or "dpo" (api/preference.py); other types are refused by resolve_spec with
    the field named (a typed Literal would answer with pydantic's generic message instead)."""

    type: str = "supervised"
    supervised: SupervisedMethod | None = None
    dpo: DpoMethod | None = None
    # OpenAI's other method section, accepted in shape so the refusal names the type, not an extra field.
    reinforcement: dict[str, Any] | None = None


INTEGRATION_TYPES = ("wandb",)


class Integration(_Strict):
    """OpenAI's `integrations` entry: stored with the job and shown on it."""

    type: str
    wandb: dict[str, Any] | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, v):
        if v not in INTEGRATION_TYPES:
            raise ValueError(f"unknown integration type {v!r} (known: {', '.join(INTEGRATION_TYPES)})")
        return v


class EvaluationSpec(_Strict):
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

    _check_file = field_validator("file")(_check_data_file)


class JobCreate(_Strict):
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
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    evaluation: EvaluationSpec | None = None
    output_uri: str | None = Field(None, description="where checkpoints and the adapter go (default: server setting)")
    priority: int = Field(0, ge=-100, le=100)

    _check_uris = field_validator("output_uri")(_check_uri)
    _check_data_files = field_validator("training_file", "validation_file")(_check_data_file)
    _check_model_name = field_validator("model")(_check_model)

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


class SpecError(ValueError):
    """A job spec that is well-typed but inconsistent; `param` is the offending field path."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


def resolve_spec(req: JobCreate) -> JobCreate:
    """Apply OpenAI hyperparameters onto `training` and check cross-field rules.

    Returns a copy whose `training` section is authoritative; raises SpecError naming the field.
    """
    training = req.training.model_copy()
    hp = _method_hyperparameters(req)
    if hp.batch_size != "auto":
        if hp.batch_size < 1:
            raise SpecError("hyperparameters.batch_size", "must be >= 1")
        training.global_batch_size = hp.batch_size
    if hp.learning_rate_multiplier != "auto":
        if hp.learning_rate_multiplier <= 0:
            raise SpecError("hyperparameters.learning_rate_multiplier", "must be > 0")
        training.learning_rate = training.learning_rate * hp.learning_rate_multiplier
    if hp.n_epochs != "auto":
        if hp.n_epochs < 1:
            raise SpecError("hyperparameters.n_epochs", "must be >= 1")
        if training.max_steps is not None:  # which one wins would be a guess: say so rather than drop one
            raise SpecError("hyperparameters.n_epochs", "set either hyperparameters.n_epochs or training.max_steps, "
                                                        "not both")
        training.n_epochs = hp.n_epochs
    if training.max_steps is None and training.n_epochs is None:
        training.n_epochs = 1

    par = req.parallelism
    auto = training.micro_batch_size == "auto"
    per_step = par.num_workers if auto else training.micro_batch_size * par.num_workers
    if training.global_batch_size % per_step:
        raise SpecError(
            "training.global_batch_size",
            f"must be a multiple of num_workers = {per_step}" if auto
            else f"must be a multiple of micro_batch_size x num_workers = {per_step}",
        )
    if training.memory_budget_mb is not None and not auto:
        raise SpecError("training.memory_budget_mb", "only applies to micro_batch_size \"auto\"")
    par.check_expert_split()
    if par.gpus_per_worker > 1:  # a worker is one rank and drives one device: the rest would sit idle
        raise SpecError("parallelism.gpus_per_worker",
                        f"must be 0 (CPU workers) or 1: each worker is one training rank on one GPU; for "
                        f"{par.num_workers * par.gpus_per_worker} GPUs ask for num_workers: "
                        f"{par.num_workers * par.gpus_per_worker} with gpus_per_worker: 1")
    return req.model_copy(update={"training": training})


def _method_hyperparameters(req: JobCreate) -> Hyperparameters:
    """The OpenAI knobs: the method section's `hyperparameters` (OpenAI's current place) over the top-level ones."""
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


# ---------------------------------------------------------------- responses


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
    parallelism: ParallelismSpec
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


# ---------------------------------------------------------------- worker -> control plane


class JobRunSpec(BaseModel):
    """Everything a driver needs to run one job; handed to the Ray job as JSON."""

    job_id: str
    spec: JobCreate  # already passed through resolve_spec
    seed: int
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
