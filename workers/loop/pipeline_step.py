"""One optimizer step of a pipelined job: this rank's pipeline runs the step's rows through its stages under 1F1B
(workers.engine.pipeline.StagePipeline), then each stage's optimizer steps.

Every rank of a pipeline takes the same examples (its data-parallel index picks them, as a CP group's ranks do).
A step's rows are padded to whole micro-batches of `training.micro_batch_size` rows (padding rows carry no loss)
and to `seq_len` tokens: a stage sends and receives fixed shapes, inferred once per shape. The last stage's loss is
each micro-batch's summed token loss, scaled as StepRunner scales it; the step's loss and tokens are summed over
the world."""

from __future__ import annotations

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
    """StepRunner's steps and validation for a rank of a pipeline stage (no tuner: the micro-batch size is fixed,
    api.models.run_config.pipeline_refusal)."""

    def __init__(self, pipeline: StagePipeline, pad_id: int, *args, **kwargs):
        super().__init__(pipeline.engine, *args, **kwargs)
        self.pipeline, self.pad_id = pipeline, pad_id

    def describe(self) -> str:
        stage, stages = self.pipeline.stage, self.pipeline.stages
        return (f"micro-batch size {self.micro_batch_size}, pipeline stage {stage + 1} of {stages} (1F1B over "
                f"{self.grad_accum_steps} micro-batches a step)")

    def run(self, step: int, train_set: list) -> tuple[float, float, float]:
        """As StepRunner.run."""
        examples, loss_tokens, scale = self._step_examples(step, train_set)
        input_ids, labels, micro_batches = self._rows(examples, self.seq_len)
        before = replace(self.pipeline.traffic)
        loss_sum = self.pipeline.run(input_ids, labels, micro_batches, scale)
        tokens = sum(len(e.input_ids) for e in examples)
        loss_sum, tokens, *stages = self.collectives.all_sum(loss_sum, tokens / self.copies,
                                                             *self._stage_figures(self.pipeline.traffic.since(before)))
        n = self.pipeline.stages
        self.figures = {name: stages[k * n:(k + 1) * n] for k, name in enumerate(STAGE_FIGURES)}
        return loss_sum, loss_tokens, tokens

    def _stage_figures(self, done: StageTraffic) -> list[float]:
        """This rank's share of its stage's STAGE_FIGURES (a stage's figure is its ranks' mean), in the slots of
        its stage: summed over the world, the figures of every stage."""
        idle, n, stage = max(done.schedule_seconds - done.busy_seconds, 0.0), self.pipeline.stages, self.pipeline.stage
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
