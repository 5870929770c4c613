"""What DeepSpeed must know of moetune's expert parallelism, the one place that touches its internals for it
(DeepSpeed 0.19.8): its expert and expert-data-parallel process groups, the tags that make ZeRO treat a parameter
as expert-parallel, and the layer class that switches on its MoE gradient handling.

EP groups are DeepSpeed's: consecutive ranks form an EP group ([0,1],[2,3] for EP=2 of 4); the ranks of a pipeline
stage that hold the same experts ([0,2],[1,3] without pipelining) form the replica ("expert data parallel") group. The job's layout (ParallelDims) derives
the same members; expert_groups checks that DeepSpeed made those.
"""

from __future__ import annotations

import functools

from moetune.api.models.parallelism import ParallelDims, expert_group_name
from moetune.workers.engine.deepspeed import init_comm

EXPERT_PLACEMENT = "autoep_expert"  # DeepSpeed's ZeRO-3 placement family for expert-parallel tensors


def expert_groups(dims: ParallelDims) -> tuple[int, object, object]:
    """(this rank's index in its EP group, the EP group or None at size 1, the replica group); creates DeepSpeed's
    groups of the layout once (torch.distributed must be up) and checks they have the layout's members."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    init_comm()
    size, world_rank = dims.expert_parallel_size, dist.get_rank()
    name = expert_group_name(size)
    if name not in groups._get_expert_parallel_group_dict():
        # within each pipeline stage (consecutive blocks of ranks, as in the layout): experts never cross stages
        groups._create_expert_and_data_parallel(size, pp_size=dims.pipeline_parallel_size)
    group, replica_group = groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)
    made = (dist.get_process_group_ranks(group), dist.get_process_group_ranks(replica_group))
    wanted = (dims.expert_group_ranks(world_rank), dims.expert_replica_ranks(world_rank))
    if made != wanted:  # a DeepSpeed whose group order changed: experts would be exchanged with the wrong ranks
        raise RuntimeError(f"DeepSpeed's expert groups of rank {world_rank} are {made}, the layout's {wanted}")
    return groups._get_expert_parallel_rank(name), group if size > 1 else None, replica_group


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
