"""A planner layout (workers.planner.memory.Layout) from its numbers, as the tests name them."""

from __future__ import annotations

from moetune.api.models.parallelism import ParallelDims
from moetune.workers.planner.memory import Layout


def layout(world: int, ep: int, zero: int, checkpointing: bool, micro_batch: int, sequences: int = 1,
           context: int = 1, stages: int = 1) -> Layout:
    dims = ParallelDims(num_workers=world, gpus_per_worker=1, expert_parallel_size=ep, zero_stage=zero,
                        context_parallel_size=context, pipeline_parallel_size=stages)
    return Layout(dims, checkpointing, micro_batch, sequences)
