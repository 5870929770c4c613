"""Which routed experts this rank holds: the one expert-placement object the loader, the expert-parallel module,
checkpoints and metrics all read.

EP rank r holds the consecutive experts [r·E/EP, (r+1)·E/EP) of an EP group (DeepSpeed's groups, made by
workers.engine.experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.errors import ErrorCode
from moetune.api.families import known_facts
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelismSpec
from moetune.workers.engine.experts import expert_group_name, expert_groups
from moetune.workers.errors import JobError


@dataclass(frozen=True)
class ExpertPlacement:
    num_experts: int
    size: int = 1  # expert_parallel_size
    rank: int = 0  # this rank's index in its EP group
    group_name: str = "ep_size_1"  # DeepSpeed's name of the EP group ("ep_size_<N>")
    group: object = None  # the EP process group (None when there is nothing to exchange)
    replica_group: object = None  # the ranks holding the same experts

    def __post_init__(self):
        # The workers' one check of this rule (the control plane's is api.models.parallelism.ParallelismSpec.check_expert_split).
        if self.num_experts % self.size:
            raise JobError(ErrorCode.invalid_request, f"parallelism.expert_parallel_size: must divide the model's "
                                              f"{self.num_experts} routed experts (got {self.size})",
                           "parallelism.expert_parallel_size")

    @property
    def count(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.count

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


def placement_at(config: dict, size: int, rank: int) -> ExpertPlacement | None:
    """The placement of EP rank `rank` without process groups (planning, inspection); None without routed experts."""
    num_experts = routed_experts(config)
    return None if num_experts is None else ExpertPlacement(num_experts, size, rank, expert_group_name(size))


def expert_placement(config: dict, size: int) -> ExpertPlacement | None:
    """This rank's placement for `config` at expert_parallel_size `size`, None for a model without routed experts.

    Creates (once) DeepSpeed's expert and expert-data-parallel groups of `size` (torch.distributed must be up)."""
    num_experts = routed_experts(config)
    if num_experts is None:
        return None
    rank, group, replica_group = expert_groups(size)
    return ExpertPlacement(num_experts, size, rank, expert_group_name(size), group, replica_group)


def needs_expert_module(placement: ExpertPlacement | None, lora: LoraSpec | None) -> bool:
    """Whether the routed experts need the expert-parallel module's process groups: they are sharded, or they get
    their own LoRA."""
    return placement is not None and (placement.sharded or (lora is not None and lora.train_experts))


def job_placement(config: dict, parallelism: ParallelismSpec, lora: LoraSpec | None) -> ExpertPlacement | None:
    """This rank's placement for a job (its `parallelism` and `lora` sections) on the model of `config`
    (torch.distributed up); DeepSpeed's expert process groups are made only where the experts leave transformers'
    module."""
    size = parallelism.expert_parallel_size
    single = placement_at(config, size, 0)
    return expert_placement(config, size) if needs_expert_module(single, lora) else single
