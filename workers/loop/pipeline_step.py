"""One optimizer step of a pipelined job: this rank's pipeline runs the step's rows through its stages under 1F1B
(workers.engine.pipeline.StagePipeline), then each stage's optimizer steps.

Every rank of a pipeline takes the same examples (its data-parallel index picks them, as a CP group's ranks do).
A step's rows are padded to whole micro-batches of the size in use (padding rows carry no loss) and to `seq_len`
tokens: a stage sends and receives fixed shapes, inferred once per shape. The last stage's loss is
each micro-batch's summed token loss, scaled as StepRunner scales it; the step's loss and tokens are summed over
the world."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch

from moetune.workers.data.sampling import eval_micro_batches
from moetune.workers.engine.pipeline import StagePipeline, StageTraffic
from moetune.workers.loop.step import StepRunner
from moetune.workers.methods.batch import IGNORE
from moetune.workers.methods.sft import Example, collate

# a step's figures of each stage (lists, stage by stage): the share of its schedule outside its forwards,
# backwards and loss (the bubble, and the sends and receives), those seconds, and the MB it sent and received
STAGE_FIGURES = ("pipeline_idle_share", "pipeline_idle_seconds", "pipeline_sent_mb", "pipeline_received_mb")


class PipelineStepRunner(StepRunner):
    """StepRunner's steps and validation for a rank of a pipeline stage.

    The micro-batch tuner measures each micro-batch's forward and counts as many in flight as 1F1B keeps on the
    stage (as many as there are stages from it on); it decides between steps from the world's maximum, as without
    stages: every stage switches at once. An OOM inside a schedule leaves the other stages waiting for this one's
    sends, so it fails the rank, recorded first (StepRunner._leave_word): the restarted group never uses that size
    again."""

    def __init__(self, pipeline: StagePipeline, pad_id: int, model, *args, **kwargs):
        """`model`: the whole model (the tuner's first size is planned on it; other stages' tensors on meta)."""
        self.pipeline, self.pad_id, self.model = pipeline, pad_id, model
        super().__init__(pipeline.engine, *args, **kwargs)
        self._fixed, self._activation = 0.0, 0.0  # the tuner's measure of a schedule's micro-batches
        if self.tuner:
            pipeline.measure = self._measured_forward

    def _planned_on(self):
        return self.model

    def describe(self) -> str:
        return f"pipeline stage {self.pipeline.stage + 1} of {self.pipeline.stages} (1F1B), {super().describe()}"

    def run(self, step: int, train_set: list) -> tuple[float, float, float]:
        """As StepRunner.run."""
        examples, loss_tokens, scale = self._step_examples(step, train_set)
        input_ids, labels, micro_batches = self._rows(examples, self.seq_len)
        before = replace(self.pipeline.traffic)
        loss_sum = self._schedule(step, input_ids, labels, micro_batches, scale)
        tokens = sum(len(e.input_ids) for e in examples)
        loss_sum, tokens, *stages = self.collectives.all_sum(loss_sum, tokens / self.copies,
                                                             *self._stage_figures(self.pipeline.traffic.since(before)))
        n = self.pipeline.stages
        self.figures = {name: stages[k * n:(k + 1) * n] for k, name in enumerate(STAGE_FIGURES)}
        return loss_sum, loss_tokens, tokens

    def _schedule(self, step: int, input_ids: torch.Tensor, labels: torch.Tensor, micro_batches: int,
                  scale: float) -> float:
        """The step's schedule, then the tuner's decision where it tunes: from what is allocated before the first
        micro-batch's forward and the most a forward adds (measured in each, not in the shape inference's), times
        the micro-batches 1F1B keeps in flight on this stage (the backward's own buffers are the budget's
        headroom)."""
        self._fixed, self._activation = float("inf"), 0.0
        try:
            self.faults.before_forward(step, True, self.micro_batch_size)
            loss_sum = self.pipeline.run(input_ids, labels, micro_batches, scale)
        except torch.OutOfMemoryError:
            if self.tuner:
                self._leave_word(step)
            raise
        if self.tuner:
            in_flight = min(self.pipeline.stages - self.pipeline.stage, micro_batches)
            per_token = self._activation * in_flight / (self.micro_batch_size * input_ids.shape[1])
            self._tune(step, *self.collectives.all_max(self._fixed, per_token))
        return loss_sum

    @contextmanager
    def _measured_forward(self):
        self.probe.begin()
        try:
            yield
        finally:
            self.probe.end()
            self._fixed = min(self._fixed, self.probe.fixed)
            self._activation = max(self._activation, self.probe.activation)

    def _stage_figures(self, done: StageTraffic) -> list[float]:
        """This rank's share of its stage's STAGE_FIGURES (a stage's figure is its ranks' mean), in the slots of
        its stage: summed over the world, the figures of every stage."""
        idle = max(done.schedule_seconds - done.busy_seconds, 0.0)
        n, stage = self.pipeline.stages, self.pipeline.stage
        mine = [0.0] * (len(STAGE_FIGURES) * n)
        values = (idle / max(done.schedule_seconds, 1e-9), idle, done.sent_bytes / 1e6, done.received_bytes / 1e6)
        for kind, value in enumerate(values):
            mine[kind * n + stage] = value / self.parallelism.stage_size
        return mine

    def validation_loss(self, valid_set: list) -> float:
        """The token-weighted mean loss over the validation set: forwards only, a whole step's rows at a time,
        every pipeline as many times (a stage's expert all-to-all spans the pipelines)."""
        self.engine.eval()
        rows = [i for chunk in eval_micro_batches(len(valid_set), self.micro_batch_size, self.data_rank,
                                                  self.data_world) for i in chunk]
        per_run = self.grad_accum_steps * self.micro_batch_size
        loss_sum = count = 0.0
        for start in range(0, len(rows), per_run):
            real = [valid_set[i] for i in rows[start:start + per_run] if i is not None]
            input_ids, labels, micro_batches = self._rows(real, self.t.seq_len)
            loss_sum += self.pipeline.run(input_ids, labels, micro_batches, train=False)
            count += sum(e.loss_tokens for e in real) / self.copies
        self.engine.train()
        loss_sum, count = self.collectives.all_sum(loss_sum, count)
        return loss_sum / max(count, 1)

    def _rows(self, examples: list, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The examples as [rows, width] input ids and labels, padded to a step's micro-batches (rows without
        loss), and how many micro-batches."""
        micro_batches = self.grad_accum_steps
        blank = Example([self.pad_id], [IGNORE])
        batch = collate(examples + [blank] * (micro_batches * self.micro_batch_size - len(examples)), self.pad_id)
        more = width - batch.labels.shape[1]
        input_ids = torch.nn.functional.pad(batch.inputs["input_ids"], (0, more), value=self.pad_id)
        labels = torch.nn.functional.pad(batch.labels, (0, more), value=IGNORE)
        return input_ids, labels, micro_batches
