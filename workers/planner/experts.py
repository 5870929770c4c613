"""The routed experts in a meta-device forward: their token routing is data-dependent (counts, sorts, splits), which
the meta device cannot run, so each MoE block's experts module is a stand-in there (workers.model), and what the real
module saves is added for each layout the planner considers. That figure is measured once per job on the real module
(the family's own, or the expert-parallel one the job would run) at the model's true widths, holding two and then four
experts: the saved bytes are a constant, plus an amount per local expert (expert LoRA keeps per-expert copies of
its factors), plus an amount per routed slot."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from moetune.api.models.lora import LoraSpec
from moetune.api.models.training import TrainingSpec
from moetune.workers.experts.module import expert_parallel
from moetune.workers.experts.placement import ExpertPlacement
from moetune.workers.families.spec import Family, in_proj_name
from moetune.workers.planner.saved import SavedBytes

# (experts held, routed slots): enough points to separate the constant, per-expert and per-slot parts
_SAMPLES = ((2, 8), (2, 16), (4, 8))


def input_width(experts) -> int:
    """The width of the tokens the experts take (hidden, or latent for a latent MoE)."""
    shape = getattr(experts, in_proj_name(experts)).shape
    return shape[1] if getattr(experts, "is_transposed", False) else shape[2]


def _sample(experts: nn.Module, count: int, dtype) -> nn.Module:
    """A copy of the meta experts module holding `count` real (zero) experts."""
    small = copy.deepcopy(experts)
    for name, param in list(small.named_parameters(recurse=False)):
        small._parameters[name] = nn.Parameter(torch.zeros((count, *param.shape[1:]), dtype=dtype),
                                               requires_grad=False)
    small.num_experts = count
    return small


def _as_job_runs_it(small: nn.Module, family: Family, lora: LoraSpec, training: TrainingSpec,
                    expert_module: bool) -> nn.Module:
    if not expert_module:
        return small
    return expert_parallel(small, family, ExpertPlacement(small.num_experts), lora, training.custom_kernels)


@dataclass(frozen=True)
class ExpertBytes:
    """Saved bytes of one MoE block's experts: constant + per local expert + per routed slot."""

    constant: float
    per_expert: float
    per_slot: float

    def of(self, local_experts: int, slots: float) -> float:
        return self.constant + self.per_expert * local_experts + self.per_slot * slots


def _saved(module: nn.Module, experts: int, slots: int, width: int, dtype) -> int:
    hidden = torch.zeros(slots, width, dtype=dtype, requires_grad=True)
    weights = torch.full((slots, 1), 1.0, dtype=dtype, requires_grad=True)
    index = (torch.arange(slots) % experts).unsqueeze(-1)
    with SavedBytes(module).counting() as counter:
        module(hidden, index, weights)
    return counter.total


def expert_bytes(experts: nn.Module, family: Family, lora: LoraSpec, training: TrainingSpec, expert_module: bool,
                 dtype) -> ExpertBytes:
    """What the job's experts module saves, given its `lora` and `training` sections. `expert_module`: the job
    replaces the family's experts by the expert-parallel module (EP > 1, expert LoRA or a quantized base)."""
    width, saved, modules = input_width(experts), {}, {}
    for count, slots in _SAMPLES:
        if count not in modules:
            with torch.random.fork_rng(devices=[]):  # expert LoRA init draws from the global RNG: leave it be
                modules[count] = _as_job_runs_it(_sample(experts, count, dtype), family, lora, training,
                                                 expert_module).train()
        saved[count, slots] = _saved(modules[count], count, slots, width, dtype)
    (e0, n0), (_, n1), (e1, _) = _SAMPLES
    per_slot = (saved[e0, n1] - saved[e0, n0]) / (n1 - n0)
    per_expert = (saved[e1, n0] - saved[e0, n0]) / (e1 - e0)
    return ExpertBytes(saved[e0, n0] - per_expert * e0 - per_slot * n0, per_expert, per_slot)
