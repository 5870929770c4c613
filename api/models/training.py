"""The job's `training` section: steps, learning rate and schedule, batch sizes, context length (staged or not),
checkpoints, kernels, the alignment check and the exported checkpoint; and the evaluation metrics it may select by."""

from __future__ import annotations

import math
from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from moetune.api.models.base import StrictModel


class SeqLenStage(StrictModel):
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


class TrainingSpec(StrictModel):
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
