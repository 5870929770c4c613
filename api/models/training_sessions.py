"""Training sessions (/v1/training_sessions): a LoRA on a base held by a worker group, driven call by call from the
user's own loop (RL: sample, score, forward_backward, optim_step). The calls' arguments and results, and what the
control plane and a session's group say to each other."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from moetune.api.models.base import StrictModel, check_model, check_uri
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.responses import ErrorInfo

SessionStatus = Literal["starting", "ready", "closing", "closed", "failed"]
OPEN_STATUSES = ("starting", "ready")
CallStatus = Literal["pending", "running", "succeeded", "failed"]
LossFn = Literal["cross_entropy", "importance_sampling", "ppo", "cispo"]


class SessionCreate(StrictModel):
    model: str = Field(..., description="A registered base model's name or a checkpoint folder's URI")
    lora: LoraSpec = Field(default_factory=lambda: LoraSpec(dropout=0.0))
    parallelism: ParallelDims = Field(default_factory=ParallelDims)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    idle_timeout_s: float = Field(900.0, gt=0, le=7 * 86400,
                                  description="With no call for this long the group saves its state as 'idle' and "
                                              "stops (the session is then closed)")
    output_uri: str | None = Field(None, description="where states and weights go (default: server setting)")
    max_recoveries: int = Field(2, ge=0, le=10,
                                description="A ready group that fails (a worker or its driver lost) is replaced by "
                                            "one resuming from the newest save_state, at most this many times; "
                                            "then the session fails")

    _model = field_validator("model")(check_model)
    _output = field_validator("output_uri")(check_uri)


class TrainingSession(BaseModel):
    id: str
    object: Literal["training_session"] = "training_session"
    status: SessionStatus
    model: str
    created_at: int
    closed_at: int | None = None
    idle_timeout_s: float
    output_uri: str
    restarts: int = 0  # worker groups started after the first (POST .../restart, and recoveries)
    recoveries: int = 0  # of those, the groups that replaced a failed one (resuming from the newest saved state)
    close_reason: str | None = None  # "closed", "idle", "restarted"
    error: ErrorInfo | None = None
    # what the current worker group loaded before it took calls: a saved state and its step, or None and 0 (a
    # fresh LoRA: the first group, one restarted with fresh=true, or none saved yet)
    restored_state: str | None = None
    restored_step: int = 0


class Datum(StrictModel):
    """One sequence. Per-token lists align with `tokens`: entry t is about predicting tokens[t] from tokens[:t],
    so entry 0 is ignored. `weights` (default 1 from position 1) masks the loss; `advantages` and the sampler's
    `logprobs` are what importance_sampling and ppo need. `targets` (default: `tokens`) are the tokens predicted,
    entry t from tokens[:t] (Tinker's explicit target tokens)."""

    tokens: list[int] = Field(..., min_length=2)
    targets: list[int] | None = None
    weights: list[float] | None = None
    advantages: list[float] | None = None
    logprobs: list[float] | None = None

    @model_validator(mode="after")
    def _aligned(self) -> Datum:
        for name in ("targets", "weights", "advantages", "logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.tokens):
                raise ValueError(f"{name} has {len(values)} entries, tokens {len(self.tokens)}: one per token")
        return self


class ForwardBackward(StrictModel):
    kind: Literal["forward_backward"] = "forward_backward"
    data: list[Datum] = Field(..., min_length=1)
    loss_fn: LossFn = "cross_entropy"
    clip_epsilon: float = Field(0.2, gt=0, lt=1, description="ppo: the ratio is clipped to [1 - e, 1 + e]")
    clip_range: tuple[float, float] | None = Field(None, description="ppo, cispo: the ratio's bounds (low, high), "
                                                                      "instead of 1 -+ clip_epsilon")
    accumulate: bool = Field(False, description="Add to the gradients of earlier forward_backward calls since the "
                                                "last optim_step (Tinker's semantics) instead of refusing to")

    @model_validator(mode="after")
    def _inputs(self) -> ForwardBackward:
        if self.loss_fn == "cross_entropy":
            return self
        for i, datum in enumerate(self.data):
            for name in ("advantages", "logprobs"):
                if getattr(datum, name) is None:
                    raise ValueError(f"data[{i}].{name} is required by loss_fn {self.loss_fn!r}")
        return self


class Forward(StrictModel):
    """The per-token log-probabilities of `data` under the current adapter, with no gradient kept (the first half of
    the SDK's forward_backward_custom: the same forward as the forward_backward that follows it)."""

    kind: Literal["forward"] = "forward"
    data: list[Datum] = Field(..., min_length=1)
    adapter: bool = Field(True, description="False: the base model alone, the adapter off (DPO's reference)")


class OptimStep(StrictModel):
    """Adam (AdamW) on the LoRA weights with the gradients of the forward_backward calls since the last step."""

    kind: Literal["optim_step"] = "optim_step"
    learning_rate: float = Field(1e-4, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.999, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip_norm: float = Field(1.0, ge=0, description="Clip the gradients' global norm to this (0: no clipping)")


class Sample(StrictModel):
    """`n` completions of each prompt (a string, tokenized without special tokens, or token ids) with the current
    adapter; stop at the tokenizer's eos, at any of `stop`, or after `max_tokens`. A stop string (as OpenAI's) ends
    the text just before its first occurrence, and the tokens before the first token that reaches into it; a stop
    token id ends the tokens before it. `seed` None: the session's seed and the call's number (reproducible either
    way). The k-th sequence of the call draws with seed + k, so a call gets the same tokens whether it ran alone or
    merged with others (consecutive queued samples that differ only in PER_CALL run as one generation)."""

    PER_CALL: ClassVar[tuple[str, ...]] = ("prompts", "n", "seed", "prompt_logprobs")

    kind: Literal["sample"] = "sample"
    prompts: list[str | list[int]] = Field(..., min_length=1)
    n: int = Field(1, ge=1, le=64)
    max_tokens: int = Field(16, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1: no top-k cut")
    stop: list[str | int] = Field(default_factory=list)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    weights: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]{1,64}$",
                                description="Sample from the adapter as save_weights saved it under this name (a "
                                            "snapshot; refused once the group no longer holds it), not the current")
    adapter: bool = Field(True, description="False: the base model alone, the adapter off (a reference, a teacher)")
    prompt_logprobs: bool = Field(False, description="Also each prompt token's log-probability")

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: list[str | int]) -> list[str | int]:
        for i, s in enumerate(stop):
            if s == "" or isinstance(s, int) and s < 0:
                raise ValueError(f"stop[{i}] is {s!r}: a stop is a non-empty string or a token id")
        return stop

    @model_validator(mode="after")
    def _weights(self) -> Sample:
        if self.weights is not None and not self.adapter:
            raise ValueError("weights names an adapter's snapshot: it cannot go with adapter false")
        return self

    @classmethod
    def mergeable(cls, first: dict, other: dict) -> bool:
        """Whether the stored arguments of two sample calls may run as one generation (alike but for PER_CALL)."""
        return all(first.get(k) == other.get(k) for k in first.keys() | other.keys() if k not in cls.PER_CALL)


class SaveState(StrictModel):
    """Weights and optimizer state under `name` (load_state resumes exactly from it, in a later group too)."""

    kind: Literal["save_state"] = "save_state"
    name: str = Field(..., pattern=r"^[A-Za-z0-9._-]{1,64}$")


class LoadState(SaveState):
    kind: Literal["load_state"] = "load_state"
    optimizer: bool = Field(True, description="Restore the Adam moments and step too (else the weights only)")
    uri: str | None = Field(None, description="Another session's saved state (the control plane sets it for Tinker's "
                                              "load from a path; its tenant checked there)")


class SaveWeights(SaveState):
    """The adapter alone, in PEFT's format, under `name` (what the serve app deploys)."""

    kind: Literal["save_weights"] = "save_weights"


CallArgs = Forward | ForwardBackward | OptimStep | Sample | SaveState | LoadState | SaveWeights


class CallCreate(BaseModel):
    call: CallArgs = Field(discriminator="kind")


class SessionCall(BaseModel):
    """A call's state; `result` once succeeded (forward_backward: loss and per-datum logprobs; forward: logprobs;
    sample: sequences; save_*: the URI), `error` once failed."""

    id: str
    object: Literal["training_session.call"] = "training_session.call"
    session_id: str
    kind: str
    status: CallStatus
    created_at: float
    finished_at: float | None = None
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None


# ---- between the control plane and a session's worker group

SESSION_INTERNAL = "/internal/v1/training_sessions/{session_id}"


class SessionRunSpec(BaseModel):
    """Everything a session's driver needs; handed to the Ray job as JSON."""

    session_id: str
    attempt: int
    spec: SessionCreate  # model resolved to a URI
    seed: int
    output_uri: str  # <output_uri>/<session id>
    restore: str | None = None  # a saved state the group loads before it takes calls (it replaces a failed one)


class TakenCall(BaseModel):
    call_id: str
    number: int  # the call's place in the session (sample's default seed)
    call: CallArgs = Field(discriminator="kind")


class NextCall(BaseModel):
    """The control plane's answer to the chief's poll: calls to run (one, or consecutive samples merged into one
    generation), `close` (the user closed the session, or a newer group replaced this one), or neither (nothing
    yet)."""

    calls: list[TakenCall] = Field(default_factory=list)
    close: bool = False


class CallOutcome(BaseModel):
    result: dict[str, Any] | None = None
    error: ErrorInfo | None = None


class GroupEnded(BaseModel):
    reason: Literal["closed", "idle", "failed"]
    error: ErrorInfo | None = None
