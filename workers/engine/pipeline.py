"""Pipeline stages under DeepSpeed: each rank's stage module (workers.pipeline) is its own ZeRO engine, and
torch.distributed.pipelining's schedule runs the micro-batches through the stages.

- DeepSpeed's groups (its `mpu`, `StageGroups`): data parallel = the rank's stage (ZeRO partitions and reduces the
  stage's parameters over it); model parallel = the rank's pipeline (its peers in the other stages), over which
  DeepSpeed sums the gradient norm, so that clipping sees the whole model's (each stage's parameters marked as its
  own: unmarked, DeepSpeed counts them on the first stage only).
- Each micro-batch's backward goes through the engine (`EngineStage`): a stage other than the last backpropagates
  Σ⟨output, the gradient the next stage sent for it⟩, whose parameter and input gradients are the stage's; the
  accumulation boundary is the schedule's last backward.
- The optimizer step runs after the schedule (`step`), never inside its last backward: it sums the norm over the
  pipeline while the stage before still waits for that backward's input gradient (a deadlock, measured on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from moetune.api.models.parallelism import ParallelDims


class StageGroups:
    """DeepSpeed's model-parallelism unit for one rank of a pipelined job."""

    def __init__(self, parallelism: ParallelDims, world_rank: int):
        # every rank creates every group, in the same order: dist.new_group is a collective of the whole world
        stages = [dist.new_group(parallelism.stage_ranks(first))
                  for first in range(0, parallelism.num_workers, parallelism.stage_size)]
        pipelines = [dist.new_group(parallelism.pipeline_ranks(within)) for within in range(parallelism.stage_size)]
        self.data = stages[parallelism.coordinates(world_rank).stage]
        self.model = pipelines[world_rank % parallelism.stage_size]

    def get_data_parallel_group(self):
        return self.data

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.data)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.data)

    def get_model_parallel_group(self):
        return self.model

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self.model)

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self.model)


class EngineStage(PipelineStage):
    """A pipeline stage whose module is a DeepSpeed engine's: its backward is the engine's."""

    def __init__(self, engine, stage_index: int, num_stages: int, device: torch.device, group=None):
        super().__init__(engine.module, stage_index, num_stages, device, group=group)
        self.engine = engine
        for param in engine.module.parameters():
            # the stage's own, not a copy on every stage: DeepSpeed's gradient norm counts a parameter without
            # this mark on model-parallel rank 0 only (it takes it for one replicated across the group)
            param.model_parallel = True

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            raise ValueError(f"a DeepSpeed stage runs whole backwards, not {backward_type!r} ones (zero-bubble "
                             "schedules split them)")
        outputs, grads, inputs = (bwd_kwargs[k] for k in ("stage_output", "output_grads", "input_values"))
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        if grads is None:  # the last stage: its output is the micro-batch's loss
            surrogate = outputs[0]
        else:
            grads = grads if isinstance(grads, (tuple, list)) else (grads,)
            surrogate = sum((out * grad).sum() for out, grad in zip(outputs, grads) if grad is not None)
        self.engine.set_gradient_accumulation_boundary(last_backward)
        self.engine.backward(surrogate, scale_wrt_gas=False)
        if not last_backward:
            self.engine.step()  # DeepSpeed's micro-step bookkeeping; the optimizer steps in `step`
        return tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs), None

    def step(self) -> None:
        """The optimizer step, after the schedule's last backward on every stage."""
        self.engine.step()
