"""The micro-batches of one optimizer step, and the online tuner that sizes them (`micro_batch_size: "auto"`).

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
and the failing rank first records its micro-batch size in storage (workers.resume.record_oom): the restarted
group never uses that size again, so it does not run into the same OOM until its restarts are spent.
"""

from __future__ import annotations

import logging
import os

from moetune.workers.data.rows import IGNORE, collate, step_examples, step_rng_seed
from moetune.workers.engine.deepspeed import set_micro_batch_size
from moetune.workers.checkpoints.run_state import record_oom

# "<rank>:<step>": that rank raises an OOM in the forward of the last micro-batch of that step, once.
# "<rank>:backward:<size>": that rank raises an OOM in every backward of a micro-batch of <size> or more (a
# memory limit the forward's prediction misses). Tests only: a real OOM cannot be caused deterministically on CPU.
INJECT_OOM_ENV = "MOETUNE_INJECT_OOM"
log = logging.getLogger("moetune.tuner")
GPU_DEFAULT_BUDGET = 0.9  # of device memory: headroom for the allocator's fragmentation and comm buffers


def token_loss_sum(logits, labels):
    """Cross-entropy summed over the positions that carry loss (labels shifted by one)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE,
                           reduction="sum")


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
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: set[int] = set()
        self.activation = 0.0

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.activation += storage.nbytes()
            return tensor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)
        self._hooks.__enter__()

    def end(self) -> None:
        import torch

        if self.device.type == "cuda":
            self.activation = torch.cuda.max_memory_allocated(self.device) - self.fixed
        else:
            self._hooks.__exit__(None, None, None)


class MicroBatchTuner:
    """Pure decision rules over agreed measurements; holds the current micro-batch size."""

    def __init__(self, per_rank: int, seq_len: int, budget_bytes: float | None, size: int = 1):
        self.sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        self.seq_len, self.budget, self.size = seq_len, budget_bytes, size
        self.ceiling = per_rank  # sizes above it failed with an OOM

    def predicted(self, size: int, fixed: float, per_token: float) -> float:
        return fixed + per_token * size * self.seq_len

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


class MicroBatchLoop:
    """Runs the micro-batches of each optimizer step for a `workers.train_loop._Worker` and, for "auto",
    tunes their size; `micro_batch_size` / `grad_accum_steps` are the sizes in use."""

    def __init__(self, worker, engine):
        t = worker.t
        self.worker, self.engine, self.t = worker, engine, t
        self.per_rank = t.global_batch_size // worker.world
        self.tuner = None
        if t.micro_batch_size == "auto":
            self.tuner = MicroBatchTuner(self.per_rank, t.seq_len, self._budget_bytes())
            self.probe = MemoryProbe(engine.module, worker.device)
            self.micro_batch_size = self.tuner.size
            set_micro_batch_size(engine, self.micro_batch_size, t.global_batch_size)
        else:
            self.micro_batch_size = t.micro_batch_size
        rank, _, what = os.environ.get(INJECT_OOM_ENV, "").partition(":")
        mine = bool(rank) and int(rank) == worker.rank
        self.inject_oom_step = int(what) if mine and what.isdigit() else None
        self.inject_backward_oom_from = int(what.split(":")[1]) if mine and what.startswith("backward:") else None

    @property
    def grad_accum_steps(self) -> int:
        return -(-self.per_rank // self.micro_batch_size)

    def _budget_bytes(self) -> float | None:
        import torch

        if self.t.memory_budget_mb is not None:
            return self.t.memory_budget_mb * 1e6
        if self.worker.device.type == "cuda":
            return GPU_DEFAULT_BUDGET * torch.cuda.get_device_properties(self.worker.device).total_memory
        return None

    def describe(self) -> str:
        if not self.tuner:
            return f"micro-batch size {self.micro_batch_size}"
        budget = "no memory limit" if self.tuner.budget is None else f"budget {self.tuner.budget / 1e6:,.1f} MB"
        return f"micro-batch size auto (starts at {self.micro_batch_size}, {budget})"

    def _forward(self, batch: dict, step: int, last: bool):
        """Token-summed loss, or None after an OOM (the partial graph is dropped with the exception)."""
        import torch

        try:
            if last and step == self.inject_oom_step:
                self.inject_oom_step = None
                raise torch.OutOfMemoryError(f"injected OOM on rank {self.worker.rank} at step {step}")
            logits = self.engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            return token_loss_sum(logits, batch["labels"])
        except torch.OutOfMemoryError:
            if not self.tuner:
                raise
        if self.worker.device.type == "cuda":
            torch.cuda.empty_cache()  # give the retry unfragmented memory
        return None

    def _backward(self, loss, step: int) -> None:
        import torch

        try:
            if self.inject_backward_oom_from and self.micro_batch_size >= self.inject_backward_oom_from:
                raise torch.OutOfMemoryError(f"injected OOM in a backward on rank {self.worker.rank} at step {step}")
            self.engine.backward(loss, scale_wrt_gas=False)
        except torch.OutOfMemoryError:
            if self.tuner:  # the peers are in a collective already: this rank fails, but leaves word first
                try:
                    record_oom(self.worker.run.output_uri, self.worker.attempt, self.worker.rank, step,
                               self.micro_batch_size)
                except Exception:  # best effort: the OOM is what the job must report
                    log.warning("could not record the OOM at micro-batch size %d", self.micro_batch_size,
                                exc_info=True)
            raise

    def run_step(self, step: int) -> tuple[float, float, float]:
        """Every micro-batch of optimizer step `step` (1-based), then the optimizer step.

        Returns (summed loss, loss tokens, tokens), each summed over all ranks.
        """
        import torch

        w, t = self.worker, self.t
        torch.manual_seed(step_rng_seed(w.run.seed, step, w.rank))
        indices = step_examples(len(w.train_set), step - 1, t.global_batch_size, w.rank, w.world, w.run.seed)
        examples = [w.train_set[i] for i in indices]
        (loss_tokens,) = w.all_sum(sum(e.loss_tokens for e in examples))
        scale = w.world / loss_tokens  # DeepSpeed averages gradients over ranks: this makes it a global token mean
        loss_sum = tokens = fixed = per_token = 0.0
        done = 0
        while done < len(examples):
            chunk = examples[done : done + self.micro_batch_size]
            last = done + len(chunk) == len(examples)
            batch = w.to_device(collate(chunk, w.tokenizer.pad_token_id))
            if self.tuner:
                self.probe.begin()
            loss = self._forward(batch, step, last)
            if self.tuner and self.worker.all_max(float(loss is None))[0]:
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
                per_token = max(per_token, self.probe.activation / batch["input_ids"].numel())
            loss_sum += loss.item()
            tokens += batch["attention_mask"].sum().item()
            done += len(chunk)
        if self.tuner:
            self._tune(step, *self.worker.all_max(fixed, per_token))
        loss_sum, tokens = w.all_sum(loss_sum, tokens)
        return loss_sum, loss_tokens, tokens

    def state(self) -> dict | None:
        """What a checkpoint keeps ("auto" only): resuming must not climb from 1 again, nor forget an OOM."""
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
                       f"earlier, so sizes from {failed} on are not used")
        self.worker.event(f"Micro-batch size {self.micro_batch_size} {'; '.join(why)} (gradient accumulation "
                          f"{self.grad_accum_steps}; the largest size allowed is {self.tuner.ceiling})",
                          data={"micro_batch_size": self.micro_batch_size, "ceiling": self.tuner.ceiling,
                                "failed_micro_batch_size": failed or None})

    def _switch(self, size: int) -> None:
        self.micro_batch_size = size
        set_micro_batch_size(self.engine, size, self.t.global_batch_size)

    def _back_off(self, step: int) -> None:
        failed = self.micro_batch_size
        self.tuner.back_off()
        self._switch(self.tuner.size)
        self.worker.event(
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
        self.worker.event(
            f"Micro-batch size {old} -> {self.micro_batch_size} from step {step + 1} (gradient accumulation "
            f"{self.grad_accum_steps}): predicted peak {predicted / 1e6:,.2f} MB", data={
                **self._decision(step + 1, reason, old), "measured_fixed_bytes": fixed,
                "measured_bytes_per_token": per_token, "predicted_bytes": predicted})

    def _decision(self, step: int, reason: str, old: int) -> dict:
        return {"step": step, "reason": reason, "previous_micro_batch_size": old,
                "micro_batch_size": self.micro_batch_size, "grad_accum_steps": self.grad_accum_steps,
                "budget_bytes": self.tuner.budget}
