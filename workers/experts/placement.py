"""Which routed experts this rank holds: the one expert-placement object the loader, the expert-parallel module,
checkpoints and metrics all read.

EP rank r holds the consecutive experts [r·E/EP, (r+1)·E/EP) of an EP group: the groups and DeepSpeed's name of them
come from the job's layout (api.models.parallelism.ParallelDims); workers.engine.experts makes DeepSpeed's.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.families import known_facts
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims, expert_group_name
from moetune.workers.engine.experts import expert_groups


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    size: int = 1  # expert_parallel_size (it divides num_experts: ParallelDims.check_model, before any worker)
    ep_rank: int = 0  # this rank's index in its EP group
    group: object = None  # the EP process group (None when there is nothing to exchange)
    replica_group: object = None  # the ranks holding the same experts

    @property
    def group_name(self) -> str:
        """DeepSpeed's name of the EP group."""
        return expert_group_name(self.size)

    @property
    def count(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """Global index of this rank's first expert."""
        return self.ep_rank * self.count

    @property
    def local(self) -> slice:
        return slice(self.first, self.first + self.count)

    @property
    def sharded(self) -> bool:
        return self.size > 1


def routed_experts(config: dict) -> int | None:
    """The routed expert count of a config.json, None for a model without a family (nothing to place)."""
    facts = known_facts(config)
    return facts.num_experts(config) if facts else None


def placement_at(config: dict, size: int, ep_rank: int) -> ExpertPlacement | None:
    """The placement of EP rank `ep_rank` without process groups (planning, inspection); None without routed
    experts."""
    num_experts = routed_experts(config)
    return None if num_experts is None else ExpertPlacement(num_experts, size, ep_rank)


def expert_placement(config: dict, dims: ParallelDims) -> ExpertPlacement | None:
    """This rank's placement for `config` in the layout `dims`, None for a model without routed experts.

    Creates (once) DeepSpeed's expert and expert-data-parallel groups (torch.distributed must be up)."""
    num_experts = routed_experts(config)
    if num_experts is None:
        return None
    ep_rank, group, replica_group = expert_groups(dims)
    return ExpertPlacement(num_experts, dims.expert_parallel_size, ep_rank, group, replica_group)


def needs_expert_module(placement: ExpertPlacement | None, lora: LoraSpec | None) -> bool:
    """Whether the routed experts need the expert-parallel module's process groups: they are sharded, or they get
    their own LoRA."""
    return placement is not None and (placement.sharded or (lora is not None and lora.train_experts))


def job_placement(config: dict, parallelism: ParallelDims, lora: LoraSpec | None) -> ExpertPlacement | None:
    """This rank's placement for a job (its `parallelism` and `lora` sections) on the model of `config`
    (torch.distributed up); DeepSpeed's expert process groups are made only where the experts leave transformers'
    module."""
    single = placement_at(config, parallelism.expert_parallel_size, 0)
    return expert_placement(config, parallelism) if needs_expert_module(single, lora) else single
