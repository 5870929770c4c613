"""What DeepSpeed must know of moetune's expert parallelism, the one place that touches its internals for it
(DeepSpeed 0.19.8): its expert and expert-data-parallel process groups, the tags that make ZeRO treat a parameter
as expert-parallel, and the layer class that switches on its MoE gradient handling.

EP groups are DeepSpeed's: consecutive ranks form an EP group ([0,1],[2,3] for EP=2 of 4); the ranks that hold the
same experts ([0,2],[1,3]) form the replica ("expert data parallel") group.
"""

from __future__ import annotations

import functools

from moetune.workers.engine.deepspeed import init_comm

EXPERT_PLACEMENT = "autoep_expert"  # DeepSpeed's ZeRO-3 placement family for expert-parallel tensors


def expert_group_name(size: int) -> str:
    """DeepSpeed's name of the EP group of `size` ranks."""
    return f"ep_size_{size}"


def expert_groups(size: int) -> tuple[int, object, object]:
    """(this rank's index in its EP group, the EP group or None at size 1, the replica group); creates DeepSpeed's
    groups of `size` once (torch.distributed must be up)."""
    from deepspeed.utils import groups

    init_comm()
    name = expert_group_name(size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(size)
    return (groups._get_expert_parallel_rank(name), groups._get_expert_parallel_group(name) if size > 1 else None,
            groups._get_expert_data_parallel_group(name))


def tag_expert_param(param, group_name: str, replica_group) -> None:
    """The attributes DeepSpeed reads to treat `param` as expert-parallel (lost on load_state_dict(assign=True)):
    ZeRO neither averages different experts' gradients nor partitions them over the wrong group."""
    param.allreduce = False
    param.group_name = group_name
    param.ds_zero_placement_family = EXPERT_PLACEMENT
    param.ds_zero_partition_group_name = group_name
    # ZeRO-3 partitions a tensor over this group: only across ranks that hold the same experts.
    param.ds_zero_partition_process_group = replica_group


@functools.cache
def as_moe_layer(cls):
    """`cls` as a DeepSpeed MoE layer: DeepSpeed only turns on its expert-parallel gradient handling
    (`has_moe_layers`: separate optimizer groups reduced within the replica group) for AutoEPMoELayer modules.
    Frozen experts must not be one: ZeRO-1/2 then asserts that no optimizer group is an MoE group. `cls.__init__`
    must not call AutoEPMoELayer's."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    class MoeLayer(cls, AutoEPMoELayer):
        def set_deepspeed_parallelism(self, *args, **kwargs):
            pass  # the groups were made with the placement (expert_groups)

    return MoeLayer
