"""The validation loss: the token-weighted mean loss over the whole validation set, across ranks. With context
parallelism a CP group's ranks take the same rows and each scores its own slice of them, as in training."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moetune.workers.data.sampling import eval_micro_batches

if TYPE_CHECKING:
    from moetune.workers.loop.step import StepRunner


def evaluate(steps: StepRunner, valid_set: list) -> float:
    """Through the step runner's engine, method, micro-batch size, data-parallel place and collectives."""
    engine, method = steps.engine, steps.method
    loss_sum = count = 0.0
    engine.eval()
    with torch.no_grad():
        for indices in eval_micro_batches(len(valid_set), steps.micro_batch_size, steps.data_rank, steps.data_world):
            real = [valid_set[i] for i in indices if i is not None]
            # A rank whose share ran out still runs a forward: under ZeRO-3 it is a collective.
            with steps.micro_batch(real or valid_set[:1]) as batch:
                loss = method.loss_sum(engine, batch)
            if real:
                loss_sum += loss.item()
                count += sum(e.loss_tokens for e in real) / steps.context_size  # each CP rank counts the rows
    engine.train()
    loss_sum, count = steps.collectives.all_sum(loss_sum, count)
    return loss_sum / count
