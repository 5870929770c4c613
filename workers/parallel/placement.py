"""Which routed experts this rank holds: the one expert-placement object the loader, the expert-parallel module,
checkpoints and metrics all read.

EP groups are DeepSpeed's: consecutive ranks form an EP group ([0,1],[2,3] for EP=2 of 4) and EP rank r holds
the consecutive experts [r·E/EP, (r+1)·E/EP); the ranks that hold the same experts ([0,2],[1,3]) form the
replica ("expert data parallel") group.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.api.errors import ErrorCode
from moetune.api.families import known_facts
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
        # The workers' one check of this rule (the control plane's is moetune.api.families.check_model_spec).
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
    return None if num_experts is None else ExpertPlacement(num_experts, size, rank, f"ep_size_{size}")


def expert_placement(config: dict, size: int) -> ExpertPlacement | None:
    """This rank's placement for `config` at expert_parallel_size `size`, None for a model without routed experts.

    Creates (once) DeepSpeed's expert and expert-data-parallel groups of `size` (torch.distributed must be up)."""
    num_experts = routed_experts(config)
    if num_experts is None:
        return None
    import deepspeed
    import torch
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    name = f"ep_size_{size}"
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return ExpertPlacement(num_experts, size, groups._get_expert_parallel_rank(name), name,
                           groups._get_expert_parallel_group(name) if size > 1 else None,
                           groups._get_expert_data_parallel_group(name))
