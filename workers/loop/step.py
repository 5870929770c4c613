"""One optimizer step: this rank's micro-batches through the engine, then the optimizer; and, for a tuned
micro-batch (`micro_batch_size: "auto"` in the request), the tuner's decisions between steps (the rules are in
workers.loop.tuner).

The step takes its dependencies explicitly: the DeepSpeed engine, the training method (examples -> batch -> loss),
the collectives, an event callback, the fault hook (tests) and a callback for OOMs it cannot recover from. A batch's
`inputs` flow unchanged into `engine(**inputs)`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetune.api.models.run_config import RunConfig
from moetune.workers.data.sampling import eval_micro_batches, step_examples, step_rng_seed
from moetune.workers.engine.deepspeed import set_micro_batch_size
from moetune.workers.loop.collectives import Collectives
from moetune.workers.loop.context_split import ContextSplit
from moetune.workers.loop.faults import NO_FAULTS, FaultHook
from moetune.workers.loop.tuner import GPU_DEFAULT_BUDGET, MemoryProbe, MicroBatchTuner

log = logging.getLogger("moetune.step")


@dataclass(frozen=True)
class RankPlace:
    """Where this rank sits in the data-parallel world, and the job's seed (data order, dropout masks)."""

    world_rank: int
    world: int
    seed: int
    device: object
    # The forward itself runs collectives (expert all-to-all at EP > 1, ZeRO-3 parameter gathers): a rank whose
    # forward fails cannot meet its peers in the next collective, so an OOM there must take the group down.
    collective_forward: bool = False
    context: ContextSplit | None = None  # context parallelism: its CP group shares each micro-batch's rows


class StepRunner:
    """Runs every optimizer step of a worker; `micro_batch_size` / `grad_accum_steps` are the sizes in use."""

    def __init__(self, engine, method, job: RunConfig, place: RankPlace, collectives: Collectives,
                 event: Callable[..., object], total_steps: int, faults: FaultHook = NO_FAULTS,
                 on_uncaught_oom: Callable[[int, int], None] | None = None):
        """`on_uncaught_oom(step, micro_batch_size)`: called before an OOM the tuner cannot recover from (in a
        backward) takes the rank down, so that later worker groups avoid that size."""
        training = job.training
        self.engine, self.method, self.t, self.place = engine, method, training, place
        self.total_steps, self.seq_len = total_steps, None  # the context length in use (seq_len_schedule)
        self.collectives, self.event, self.faults, self.on_uncaught_oom = collectives, event, faults, on_uncaught_oom
        # which examples it trains on (a CP group's ranks train on the same ones), and how often a CP group counts
        # each of them
        par = job.parallelism
        self.data_rank, self.data_world = par.coordinates(place.world_rank).data_rank, par.data_parallel_size
        self.parallelism, self.context_size = par, par.context_parallel_size
        self.copies = par.context_parallel_size * par.pipeline_parallel_size  # ranks that take the same examples
        self.per_rank = training.global_batch_size // self.data_world
        self.tuner, self.figures = None, {}  # figures: the method's own metrics of the last step run
        if training.tune_micro_batch:
            sequences = method.sequences_per_example if method else 1  # a harness that only plans has no method
            self.tuner = MicroBatchTuner.planned(self._planned_on(), self.per_rank, job, self._budget_bytes(),
                                                 place.device, sequences)
            # each rank planned from its own free memory: all start at the smallest, or they run different numbers
            # of micro-batches and one waits alone in the experts' all-to-all or ZeRO's reductions
            self.tuner.size = int(collectives.all_min(self.tuner.size)[0])
            self.probe = MemoryProbe(engine.module, place.device)
            self._switch(self.tuner.size)
        else:
            self.micro_batch_size = training.micro_batch_size

    def _planned_on(self):
        """The model the tuner's first size is planned on."""
        return self.engine.module

    @property
    def grad_accum_steps(self) -> int:
        return -(-self.per_rank // self.micro_batch_size)

    def _budget_bytes(self) -> float | None:
        if self.t.memory_budget_mb is not None:
            return self.t.memory_budget_mb * 1e6
        if self.place.device.type == "cuda":
            return GPU_DEFAULT_BUDGET * torch.cuda.get_device_properties(self.place.device).total_memory
        return None

    def describe(self) -> str:
        if not self.tuner:
            return f"micro-batch size {self.micro_batch_size}"
        budget = "no memory limit" if self.tuner.budget is None else f"budget {self.tuner.budget / 1e6:,.1f} MB"
        return f"micro-batch size auto (starts at {self.micro_batch_size}, {budget})"

    def _forward(self, batch, step: int, last: bool):
        """Token-summed loss, or None after an OOM (the partial graph is dropped with the exception). Where the
        forward runs collectives, the peers of a failed rank wait in the forward's next one: no rank can join the
        back-off's vote, so the OOM is recorded and raised, and Ray Train restarts the group from the newest
        checkpoint (as for an OOM in a backward)."""
        try:
            self.faults.before_forward(step, last, self.micro_batch_size)
            return self.method.loss_sum(self.engine, batch)
        except torch.OutOfMemoryError:
            if not self.tuner:
                raise
            if self.place.collective_forward and self.place.world > 1:
                self._leave_word(step)
                raise
        if self.place.device.type == "cuda":
            torch.cuda.empty_cache()  # give the retry unfragmented memory
        return None

    def _backward(self, loss, step: int) -> None:
        try:
            self.faults.before_backward(step, self.micro_batch_size)
            self.engine.backward(loss, scale_wrt_gas=False)
        except torch.OutOfMemoryError:
            if self.tuner:  # the peers are in a collective already: this rank fails, but leaves word first
                self._leave_word(step)
            raise

    def _leave_word(self, step: int) -> None:
        """Records an OOM this rank cannot recover from, so that later worker groups avoid its micro-batch size."""
        if not self.on_uncaught_oom:
            return
        try:
            self.on_uncaught_oom(step, self.micro_batch_size)
        except Exception:  # best effort: the OOM is what the job must report
            log.warning("could not record the OOM at micro-batch size %d", self.micro_batch_size, exc_info=True)

    def run(self, step: int, train_set: list) -> tuple[float, float, float]:
        """Every micro-batch of optimizer step `step` (1-based) over `train_set`, then the optimizer step.

        Returns (summed loss, loss tokens, tokens), each summed over all ranks. Each micro-batch's loss is divided
        by the loss tokens of the whole global batch, so neither the loss nor the gradient depends on the cut. The
        method's figures of the micro-batches that count (not one redone after an OOM) are then in `figures`.
        """
        p = self.place
        examples, loss_tokens, scale = self._step_examples(step, train_set)
        loss_sum = tokens = fixed = per_token = 0.0
        done, figure_sums = 0, None
        while done < len(examples):
            chunk = examples[done : done + self.micro_batch_size]
            last = done + len(chunk) == len(examples)
            with self.micro_batch(chunk) as batch:
                if self.tuner:
                    self.probe.begin()
                loss = self._forward(batch, step, last)
                if self.tuner and self.collectives.all_max(float(loss is None))[0]:
                    self.probe.end()
                    del loss  # ranks that did not fail drop their graph too
                    self._back_off(step)
                    continue
                self.engine.set_gradient_accumulation_boundary(last)
                self._backward(loss * scale, step)
            self.engine.step()  # the optimizer steps only at the boundary
            if self.tuner:
                self.probe.end()
                fixed = max(fixed, self.probe.fixed)
                per_token = max(per_token, self.probe.activation / batch.labels.numel())
            loss_sum += loss.item()
            sums = self.method.figure_sums()
            figure_sums = sums if figure_sums is None else [a + b for a, b in zip(figure_sums, sums)]
            tokens += batch.tokens
            done += len(chunk)
        if self.tuner:
            self._tune(step, *self.collectives.all_max(fixed, per_token))
        loss_sum, tokens, *figure_sums = self.collectives.all_sum(loss_sum, tokens / self.copies, *figure_sums)
        self.figures = self.method.figures(figure_sums)
        return loss_sum, loss_tokens, tokens

    def _step_examples(self, step: int, train_set: list) -> tuple[list, float, float]:
        """This rank's examples of step `step` (within the context length in use), the whole global batch's loss
        tokens, and the scale of each micro-batch's summed loss: DeepSpeed averages gradients over a stage's ranks
        (all of them without stages), so the scaled gradient is the global batch's token mean."""
        p, t = self.place, self.t
        self._context_stage(step)
        torch.manual_seed(step_rng_seed(p.seed, step, p.world_rank))
        indices = step_examples(len(train_set), step - 1, t.global_batch_size, self.data_rank, self.data_world,
                               p.seed)
        examples = [train_set[i].truncated(self.seq_len) for i in indices]
        (loss_tokens,) = self.collectives.all_sum(sum(e.loss_tokens for e in examples) / self.copies)
        loss_tokens = max(loss_tokens, 1)  # an early stage can cut a batch's every answer: a zero loss, no NaN
        return examples, loss_tokens, self.parallelism.stage_size / loss_tokens

    def validation_loss(self, valid_set: list) -> float:
        """The token-weighted mean loss over the whole validation set, across ranks. With context parallelism a CP
        group's ranks take the same rows and each scores its own slice of them, as in training."""
        loss_sum = count = 0.0
        self.engine.eval()
        with torch.no_grad():
            for indices in eval_micro_batches(len(valid_set), self.micro_batch_size, self.data_rank,
                                              self.data_world):
                real = [valid_set[i] for i in indices if i is not None]
                # A rank whose share ran out still runs a forward: under ZeRO-3 it is a collective.
                with self.micro_batch(real or valid_set[:1]) as batch:
                    loss = self.method.loss_sum(self.engine, batch)
                if real:
                    loss_sum += loss.item()
                    count += sum(e.loss_tokens for e in real) / self.context_size  # each CP rank counts the rows
        self.engine.train()
        loss_sum, count = self.collectives.all_sum(loss_sum, count)
        return loss_sum / count

    @contextlib.contextmanager
    def micro_batch(self, chunk: list):
        """The examples' micro-batch on this rank's device (its slice, inside a CP forward, with context
        parallelism): the forward and the backward run inside."""
        batch = self.method.collate(chunk)
        if self.place.context is None:
            yield batch.to(self.place.device)
        else:
            with self.place.context.running(batch, self.place.device) as part:
                yield part

    def _context_stage(self, step: int) -> None:
        """The context length of `step`; a new stage of training.seq_len_schedule is announced, and the tuner
        measures afresh at its length (not at the first step run: a resumed tuner keeps its state)."""
        seq_len, first = self.t.seq_len_at(step, self.total_steps), self.seq_len is None
        if seq_len == self.seq_len:
            return
        self.seq_len = seq_len
        if self.tuner and first:
            self.tuner.seq_len = seq_len
        elif self.tuner:
            self.tuner.new_stage(seq_len)
            self._switch(self.tuner.size)
        if self.t.seq_len_schedule:
            self.event(f"Context length {seq_len:,} tokens from step {step}"
                       + (f" (micro-batch size measured afresh from {self.micro_batch_size})"
                          if self.tuner and not first else ""),
                       data={"step": step, "seq_len": seq_len, "micro_batch_size": self.micro_batch_size})

    def state(self) -> dict | None:
        """What a checkpoint keeps (a tuned micro-batch only): resuming must not climb from 1 again, nor forget an
        OOM."""
        return self.tuner.state() if self.tuner else None

    def restore(self, size: int, ceiling: int, failed: int) -> None:
        """The checkpoint's tuner state (`size` 0: none), then no size from `failed` on (0: no recorded OOM)."""
        restored = self.tuner.restore(size, ceiling) if size else False
        if failed:
            self.tuner.exclude_from(failed)
        if not (restored or failed):
            return
        self._switch(self.tuner.size)
        why = ["restored from the checkpoint" if restored else "starting afresh"]
        if failed:
            why.append(f"a worker ran out of memory at micro-batch size {failed} in a backward or collective "
                       f"earlier (or a forward with collectives: expert parallelism, ZeRO-3), so sizes from "
                       f"{failed} on are not used")
        self.event(f"Micro-batch size {self.micro_batch_size} {'; '.join(why)} (gradient accumulation "
                   f"{self.grad_accum_steps}; the largest size allowed is {self.tuner.ceiling})",
                   data={"micro_batch_size": self.micro_batch_size, "ceiling": self.tuner.ceiling,
                         "failed_micro_batch_size": failed or None})

    def _switch(self, size: int) -> None:
        self.micro_batch_size = size
        set_micro_batch_size(self.engine, size, self.t.global_batch_size, self.parallelism)

    def _back_off(self, step: int) -> None:
        failed = self.micro_batch_size
        self.tuner.back_off()
        self._switch(self.tuner.size)
        self.event(
            f"Out of memory at micro-batch size {failed} on a worker in step {step}: all workers back off to "
            f"{self.micro_batch_size} (gradient accumulation {self.grad_accum_steps}) and redo the step's rest",
            level="warn", data=self._decision(step, "oom", failed))

    def _tune(self, step: int, fixed: float, per_token: float) -> None:
        old = self.micro_batch_size
        reason = self.tuner.after_step(fixed, per_token)
        if reason is None:
            return
        self._switch(self.tuner.size)
        predicted = self.tuner.predicted(self.micro_batch_size, fixed, per_token)
        self.event(
            f"Micro-batch size {old} -> {self.micro_batch_size} from step {step + 1} (gradient accumulation "
            f"{self.grad_accum_steps}): predicted peak {predicted / 1e6:,.2f} MB", data={
                **self._decision(step + 1, reason, old), "measured_fixed_bytes": fixed,
                "measured_bytes_per_token": per_token, "predicted_bytes": predicted})

    def _decision(self, step: int, reason: str, old: int) -> dict:
        return {"step": step, "reason": reason, "previous_micro_batch_size": old,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "budget_bytes": self.tuner.budget}
