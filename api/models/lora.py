"""The job's `lora` section: rank, alpha, dropout, what LoRA adapts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from moetune.api.models.base import StrictModel


class LoraSpec(StrictModel):
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
