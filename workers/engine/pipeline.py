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
- `StagePipeline` runs a job's steps: one 1F1B schedule for each shape of step (torch.distributed.pipelining infers
  what a stage sends and receives once per stage object, by a forward of the first micro-batch), and what the
  stage did (`StageTraffic`: busy seconds, bytes sent and received).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

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


@dataclass
class StageTraffic:
    """What a stage did so far: seconds in its schedules, of them in its forwards, backwards and loss (the rest is
    spent sending, receiving and waiting: the bubble), and the bytes it sent and received."""

    schedule_seconds: float = 0.0
    busy_seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0

    def since(self, before: StageTraffic) -> StageTraffic:
        return StageTraffic(*(now - then for now, then in zip(astuple(self), astuple(before))))

    @contextmanager
    def busy(self):
        """Counts the time inside as the stage's work."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.busy_seconds += time.perf_counter() - started


def _bytes(ops: list) -> int:
    return sum(op.tensor.numel() * op.tensor.element_size() for op in ops)


class EngineStage(PipelineStage):
    """A pipeline stage whose module is a DeepSpeed engine's: its backward is the engine's."""

    def __init__(self, engine, stage_index: int, num_stages: int, device: torch.device, group=None,
                 traffic: StageTraffic | None = None,
                 forward_context: Callable[[], AbstractContextManager] = nullcontext):
        """`forward_context()`: entered around each micro-batch's forward (the tuner's memory measure)."""
        super().__init__(engine.module, stage_index, num_stages, device, group=group)
        self.engine, self.traffic, self.forward_context = engine, traffic or StageTraffic(), forward_context
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

    def forward_one_chunk(self, *args, **kwargs):
        with self.traffic.busy(), self.forward_context():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.traffic.busy():
            return super().backward_one_chunk(*args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.traffic.sent_bytes += _bytes(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.traffic.sent_bytes += _bytes(ops)
        return ops

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        self.traffic.received_bytes += _bytes(ops)
        return ops

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        self.traffic.received_bytes += _bytes(ops)
        return ops


class StagePipeline:
    """One rank's stage of a pipelined job: `run` takes a step's (or a validation pass's) rows of this rank's
    pipeline through 1F1B; the last stage scores each micro-batch's output with `loss(output, labels)` (summed over
    its tokens)."""

    def __init__(self, engine, stage: int, stages: int, device: torch.device, group,
                 loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], traffic: StageTraffic):
        self.engine, self.stage, self.stages, self.device, self.group = engine, stage, stages, device, group
        self.loss, self.scale, self.traffic = loss, 1.0, traffic
        self.measure: Callable[[], AbstractContextManager] | None = None  # around each micro-batch's forward
        self._shape, self._schedule = None, None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    def _scaled_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.traffic.busy():
            return self.loss(output, labels) * self.scale

    def _schedule_of(self, input_ids: torch.Tensor, micro_batches: int) -> Schedule1F1B:
        """The schedule of this shape of step: the last one's, or a new stage's (every rank of a pipeline meets
        the same shapes in the same order, so they rebuild together)."""
        shape = (tuple(input_ids.shape), micro_batches)
        if shape != self._shape:
            stage = EngineStage(self.engine, self.stage, self.stages, self.device, self.group, self.traffic,
                                lambda: self.measure() if self.measure else nullcontext())
            self._schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=self._scaled_loss,
                                          scale_grads=False)
            self._shape = shape
        return self._schedule

    def run(self, input_ids: torch.Tensor, labels: torch.Tensor, micro_batches: int, scale: float = 1.0,
            train: bool = True) -> float:
        """`input_ids` and `labels` ([rows, T], cut into `micro_batches` equal micro-batches) through the pipeline:
        forward and backward, scaled by `scale`, then the optimizer step (`train`), or forwards only. Returns the
        summed loss on the last stage, 0 on the others."""
        schedule, losses, started = self._schedule_of(input_ids, micro_batches), [], time.perf_counter()
        self.scale = scale
        args = (input_ids.to(self.device),) if self.is_first else ()
        labels = labels.to(self.device)
        if train:
            schedule.step(*args, target=labels, losses=losses, return_outputs=False)
            self.engine.step()  # the optimizer, after the last backward of every stage (see EngineStage.step)
        else:
            with torch.no_grad():
                schedule.eval(*args, target=labels, losses=losses, return_outputs=False)
        self.traffic.schedule_seconds += time.perf_counter() - started
        return float(sum(loss.item() for loss in losses)) / scale
