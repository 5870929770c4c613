"""A job's run config: every value its workers, its planner and its tuner read, resolved once at submission from
the request (OpenAI's knobs applied, steps or epochs decided, `"auto"` made a value), the model's config.json and
the memory plan. The control plane stores it with the job and ships it to the driver; nothing below the control
plane reads a request.

resolve_run_config is the one function that turns a request into one.
"""

from __future__ import annotations

from pydantic import Field

from moetune.api.models.base import SpecError, StrictModel
from moetune.api.models.evaluation import EvaluationSpec
from moetune.api.models.job_create import JobCreate, method_hyperparameters
from moetune.api.models.lora import LoraSpec
from moetune.api.models.method import Method
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.training import TrainingSpec
from moetune.api.plans import Plan


class RunTraining(TrainingSpec):
    """The `training` section resolved: `max_steps` or `n_epochs` set, OpenAI's knobs applied, no `"auto"`."""

    # With tune_micro_batch, the size before the tuner's first measurement (workers.loop.tuner); else the size.
    micro_batch_size: int = Field(1, ge=1)
    tune_micro_batch: bool = False
    activation_checkpointing: bool = False


class RunConfig(StrictModel):
    model: str  # the checkpoint folder's URI
    training_file: str | None = None  # a URI; None for a training session (its batches come with its calls)
    validation_file: str | None = None
    seed: int = Field(..., ge=0, le=2**31 - 1)
    lora: LoraSpec = Field(default_factory=LoraSpec)
    parallelism: ParallelDims = Field(default_factory=ParallelDims)
    training: RunTraining = Field(default_factory=RunTraining)
    method: Method | None = None
    evaluation: EvaluationSpec | None = None

    def request_body(self) -> dict:
        """A POST /v1/fine_tuning/jobs body that resolves to this run config again (the report's "reproduce")."""
        body = self.model_dump(mode="json", exclude_none=True)
        training = body["training"]
        if training.pop("tune_micro_batch"):
            training["micro_batch_size"] = "auto"
        return body


def resolve_run_config(request: JobCreate, seed: int, plan: Plan | None = None, *,
                       planning: bool = False) -> RunConfig:
    """`request` (its inputs already URIs) as a run config; raises SpecError naming the field. The one place that
    turns a request's `"auto"` into values. `planning`: for a plan only (`moetune plan`, the plans route), which
    may ask about pipeline stages a job of this request cannot run (pipeline_refusal).

    `"auto"`: `micro_batch_size` is tuned online from 1 (`tune_micro_batch`); `activation_checkpointing` is what
    the memory plan of the submitted layout chose (`plan`, the planner's answer on the configured cluster);
    without a plan, off on CPU workers (their memory budget bounds only activations) and on for GPU workers
    (nothing says the device holds the job without it: configure MOETUNE_CLUSTER to let the plan decide)."""
    training = _apply_hyperparameters(request)
    par = request.parallelism
    par.check_world()
    tuned = training["micro_batch_size"] == "auto"
    if not planning and (refusal := pipeline_refusal(par, request.method, request.evaluation)):
        raise refusal
    per_step = par.data_parallel_size * (1 if tuned else training["micro_batch_size"])
    if training["global_batch_size"] % per_step:
        replicas = ("num_workers" if par.data_parallel_size == par.num_workers
                    else "the data-parallel size (num_workers / (pipeline x context parallel sizes))")
        raise SpecError("training.global_batch_size",
                        f"must be a multiple of {'' if tuned else 'micro_batch_size x '}{replicas} = {per_step}")
    if refusal := micro_batches_refusal(par, training["global_batch_size"], training["micro_batch_size"]):
        raise refusal
    if training["memory_budget_mb"] is not None and not tuned:
        raise SpecError("training.memory_budget_mb", "only applies to micro_batch_size \"auto\"")
    par.check_sequence(training["seq_len"])
    if par.context_parallel_size > 1 and (refusal := context_parallel_refusal(request.method,
                                                                              training["custom_kernels"])):
        raise refusal
    if tuned:
        training.update(micro_batch_size=1, tune_micro_batch=True)
    if training["activation_checkpointing"] == "auto":
        training["activation_checkpointing"] = (plan.submitted.activation_checkpointing if plan is not None
                                                else par.gpus_per_worker > 0)
    return RunConfig(model=request.model, training_file=request.training_file,
                     validation_file=request.validation_file, seed=seed, lora=request.lora, parallelism=par,
                     training=RunTraining.model_validate(training), method=request.method,
                     evaluation=request.evaluation)


def micro_batches_refusal(par: ParallelDims, global_batch_size: int, micro_batch_size: int | str) -> SpecError | None:
    """Why a step of `par`'s pipeline stages cannot run in 1F1B, None when it can: each pipeline needs at least as
    many micro-batches a step as it has stages (the tuner's sizes are kept to those, from 1)."""
    stages, tuned = par.pipeline_parallel_size, micro_batch_size == "auto"
    per_rank = global_batch_size // par.data_parallel_size
    if stages == 1 or per_rank // (1 if tuned else micro_batch_size) >= stages:
        return None
    field = "training.global_batch_size" if tuned else "training.micro_batch_size"
    return SpecError(field, f"a pipeline of {stages} stages runs at least {stages} micro-batches a step: "
                            f"global_batch_size / the data-parallel size ({per_rank}) / micro_batch_size "
                            f"({1 if tuned else micro_batch_size}) must be at least {stages}")


def pipeline_refusal(par: ParallelDims, method: Method | None, evaluation: EvaluationSpec | None) -> SpecError | None:
    """Why a job of this method and evaluation cannot run `par`'s pipeline stages, None when it can (or has none):
    each stage runs whole supervised rows and scores their loss only (workers.loop.pipeline_step)."""
    if par.pipeline_parallel_size == 1:
        return None
    if method is not None and method.type != "supervised":
        return SpecError("parallelism.pipeline_parallel_size",
                         f"pipeline stages run supervised jobs only, not {method.type!r}")
    if par.context_parallel_size > 1:
        return SpecError("parallelism.context_parallel_size", "must be 1 with pipeline_parallel_size > 1 (context "
                                                              "parallelism does not run on pipeline stages yet)")
    if evaluation is not None:
        return SpecError("evaluation", "generation-based evaluation does not run on pipeline stages yet; a "
                                       "validation_file gives a validation loss")
    return None


def context_parallel_refusal(method: Method | None, custom_kernels: bool) -> SpecError | None:
    """Why a job of this method and kernels cannot be split over context-parallel ranks, None when it can: the step
    cuts a supervised micro-batch's rows, and the kernel swaps run the CP path."""
    if method is not None and method.type != "supervised":
        return SpecError("parallelism.context_parallel_size",
                         f"context parallelism runs supervised jobs only, not {method.type!r}")
    if not custom_kernels:
        return SpecError("training.custom_kernels", "must be true with context_parallel_size > 1: the custom kernels "
                                                    "carry the context-parallel path")
    return None


def _apply_hyperparameters(request: JobCreate) -> dict:
    """The training section's fields with OpenAI's knobs (method's over top-level) applied."""
    training = request.training.model_dump()
    hp = method_hyperparameters(request)
    if hp.batch_size != "auto":
        if hp.batch_size < 1:
            raise SpecError("hyperparameters.batch_size", "must be >= 1")
        training["global_batch_size"] = hp.batch_size
    if hp.learning_rate_multiplier != "auto":
        if hp.learning_rate_multiplier <= 0:
            raise SpecError("hyperparameters.learning_rate_multiplier", "must be > 0")
        training["learning_rate"] *= hp.learning_rate_multiplier
    if hp.n_epochs != "auto":
        if hp.n_epochs < 1:
            raise SpecError("hyperparameters.n_epochs", "must be >= 1")
        if training["max_steps"] is not None:  # which one wins would be a guess: say so rather than drop one
            raise SpecError("hyperparameters.n_epochs", "set either hyperparameters.n_epochs or training.max_steps, "
                                                        "not both")
        training["n_epochs"] = hp.n_epochs
    if training["max_steps"] is None and training["n_epochs"] is None:
        training["n_epochs"] = 1
    return training


def session_run_config(model: str, lora: LoraSpec, parallelism: ParallelDims, seed: int) -> RunConfig:
    """A training session's run config: its base, LoRA and layout; one sequence per rank per micro-batch (each call
    brings its own batch, so no training file, schedule or alignment check)."""
    return RunConfig(model=model, seed=seed, lora=lora, parallelism=parallelism, training=RunTraining(
        global_batch_size=parallelism.data_parallel_size, n_epochs=1, alignment_check=False))
