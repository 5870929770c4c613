"""The online micro-batch tuner (`micro_batch_size: "auto"`): its memory measure and its decision rules; the step
(workers.loop.step) runs the micro-batches and applies the decisions.

Loss: each micro-batch's token-summed loss is divided by the loss tokens of the whole global batch (all
ranks), so neither the reported loss nor the gradient depends on how a step is cut into micro-batches; a
tuned run and a fixed run with the same global batch see the same numbers.

Memory, measured per micro-batch the same way on every device: a fixed part (what is allocated before the
forward) plus an activation part that grows with the tokens of the micro-batch. On CUDA both come from the
allocator (peak allocated minus allocated at the start); on CPU, which has no device allocator to ask, the
activation part is the bytes of tensors autograd saves for backward (parameters excluded), counted through
saved-tensor hooks: deterministic, so the tuner behaves the same on every run.

Tuning: decisions are taken only between optimizer steps, from measurements all-reduced with MAX over ranks,
so every rank computes the same decision and switches at the same step; the global batch stays fixed and
gradient accumulation absorbs the change. The size grows one divisor of the per-rank batch at a time while
the prediction for the next size fits the budget; predictions assume every sequence of the micro-batch is
seq_len long, so a size tuned on short sequences still fits long ones. An OOM during a forward on any rank
is agreed on by all ranks before anyone starts the backward (one all-reduce per micro-batch), so no rank is
left waiting in a collective: all halve the size, never grow back to the size that failed (a fragmented
allocator fails there again), and redo the failed micro-batch and the rest of the step. The failed
micro-batch has produced no gradient anywhere; the finished ones keep theirs, which is exactly what a
restart of the step would recompute. Limit: an OOM during a backward or inside a forward's collective
(expert-parallel all-to-all, a ZeRO-3 gather) cannot be agreed on before the peers enter their next
collective; it fails the rank like a lost worker. The headroom prediction exists to keep the tuner away from it,
and the failing rank first records its micro-batch size in storage (workers.checkpoints.run_state.record_oom): the
restarted group never uses that size again, so it does not run into the same OOM until its restarts are spent.
"""

from __future__ import annotations

from moetune.api.models.run_config import RunConfig
from moetune.workers.planner import starting_micro_batch
from moetune.workers.planner.memory import USABLE_FRACTION
from moetune.workers.planner.saved import SavedBytes

GPU_DEFAULT_BUDGET = USABLE_FRACTION  # of device memory: headroom for the allocator's fragmentation and comm buffers


class MemoryProbe:
    """Fixed and activation bytes of one micro-batch (see the module docstring)."""

    def __init__(self, model, device):
        self.model, self.device = model, device
        self.fixed = self.activation = 0.0

    def begin(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.fixed = float(torch.cuda.memory_allocated(self.device))
            return
        self._saved = SavedBytes(self.model)
        self._counting = self._saved.counting()
        self._counting.__enter__()

    def end(self) -> None:
        import torch

        if self.device.type == "cuda":
            self.activation = torch.cuda.max_memory_allocated(self.device) - self.fixed
        else:
            self._counting.__exit__(None, None, None)
            self.activation = float(self._saved.total)


class MicroBatchTuner:
    """Pure decision rules over agreed measurements; holds the current micro-batch size."""

    def __init__(self, per_rank: int, seq_len: int, budget_bytes: float | None, size: int = 1, sequences: int = 1,
                 least_micro_batches: int = 1):
        """Sizes count examples, each `sequences` sequences of the micro-batch (the method's sequences_per_example:
        DPO's chosen and rejected are 2); each size cuts a step into `least_micro_batches` or more (a pipeline's
        1F1B needs as many as it has stages)."""
        self.sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0 and per_rank // d >= least_micro_batches]
        size = max(s for s in self.sizes if s <= size)
        self.seq_len, self.budget, self.size, self.sequences = seq_len, budget_bytes, size, sequences
        self.ceiling = self.sizes[-1]  # sizes above it failed with an OOM

    @classmethod
    def planned(cls, model, per_rank: int, job: RunConfig, budget_bytes: float | None, device,
                sequences: int = 1) -> MicroBatchTuner:
        """Starts at the planner's micro-batch size (workers.planner): the largest whose planned activations fit
        the budget less the measure's fixed part, what is allocated now on a GPU (on CPU the measure has none);
        at 1 without a budget. A rank's start is its own: the step agrees on one (StepRunner)."""
        size = 1
        if budget_bytes is not None:
            import torch

            fixed = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            size = starting_micro_batch(model, job, per_rank, budget_bytes - fixed, sequences)
        return cls(per_rank, job.training.seq_len, budget_bytes, size, sequences,
                   job.parallelism.pipeline_parallel_size)

    def predicted(self, size: int, fixed: float, per_token: float) -> float:
        """`per_token`: activation bytes per token of the micro-batch, all its sequences' tokens counted."""
        return fixed + per_token * size * self.sequences * self.seq_len

    def _fits(self, size: int, fixed: float, per_token: float) -> bool:
        return size <= self.ceiling and (self.budget is None or self.predicted(size, fixed, per_token) <= self.budget)

    def after_step(self, fixed: float, per_token: float) -> str | None:
        """Next step's size from this step's measurement; returns "grow" / "shrink" when it changes."""
        if not self._fits(self.size, fixed, per_token):
            fitting = [s for s in self.sizes if s < self.size and self._fits(s, fixed, per_token)]
            new = fitting[-1] if fitting else self.sizes[0]
            if new == self.size:
                return None
            self.size = new
            return "shrink"
        larger = [s for s in self.sizes if s > self.size]
        if larger and self._fits(larger[0], fixed, per_token):
            self.size = larger[0]
            return "grow"
        return None

    def new_stage(self, seq_len: int) -> None:
        """A longer context from now on: climb again from the smallest size, measuring at the new length (a size
        that ran out of memory at a shorter one stays excluded)."""
        self.seq_len, self.size = seq_len, self.sizes[0]

    def state(self) -> dict:
        return {"size": self.size, "ceiling": self.ceiling}

    def restore(self, size: int, ceiling: int) -> bool:
        """Continues from a checkpoint's state; False (and starts afresh) if the batch is split differently now."""
        if size not in self.sizes or ceiling not in self.sizes:
            return False
        self.size, self.ceiling = size, ceiling
        return True

    def exclude_from(self, failed: int) -> None:
        """Never `failed` or more again (an OOM the loop could not catch happened there)."""
        self.ceiling = min(self.ceiling, max([s for s in self.sizes if s < failed] or [self.sizes[0]]))
        self.size = min(self.size, self.ceiling)

    def back_off(self) -> None:
        """After an OOM at the current size: half of it at most, and never that size again."""
        self.ceiling = max([s for s in self.sizes if s < self.size] or [self.sizes[0]])
        self.size = max(s for s in self.sizes if s <= max(self.size // 2, 1))
