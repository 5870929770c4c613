"""Frozen weights put into their ZeRO-3 partition as they load (DeepSpeed 0.19.8), so that no rank ever holds its
whole share of the base: the loader fills a few parameters whole, hands them here, and each is partitioned (its
whole tensor freed) before the next are read.

What deepspeed.initialize would otherwise do to an unpartitioned model, parameter by parameter
(zero.Init(module=...): convert, broadcast from the partition group's first rank, partition), done at load without
the broadcast: every rank streamed the same checkpoint bytes. The engine later converts what is still whole (LoRA)
with this same zero.Init, and takes the partitioned parameters as they are."""

from __future__ import annotations

from moetune.api.models.parallelism import ParallelDims
from moetune.api.models.run_config import RunTraining
from moetune.workers.engine.deepspeed import deepspeed_config, init_comm
from moetune.workers.engine.experts import tag_expert_param


class Zero3Partitioner:
    """Partitions one parameter at a time over the job's data-parallel ranks, or, for a routed-expert share, over
    the ranks holding the same experts (its replica group)."""

    def __init__(self, training: RunTraining, parallelism: ParallelDims, world_size: int, bf16: bool):
        import deepspeed
        import torch

        init_comm()
        # Over an empty module: DeepSpeed's partitioner for the job's config, which also puts in ZeRO-3's
        # memory-efficient linear, as deepspeed.initialize's own zero.Init(module=model) would.
        self._init = deepspeed.zero.Init(module=torch.nn.Module(),
                                         config_dict_or_path=deepspeed_config(training, parallelism, world_size, bf16))

    def __call__(self, param, expert_group: tuple[str, object] | None = None) -> None:
        """`param`, whole and loaded, becomes this rank's partition of it. `expert_group`: (DeepSpeed's EP group
        name, replica group) of a routed-expert share."""
        if expert_group is not None:
            tag_expert_param(param, *expert_group)
        self._init._convert_to_deepspeed_param(param)
        param.partition()
