"""The validation loss: the token-weighted mean loss over the whole validation set, across ranks."""

from __future__ import annotations

import torch

from moetune.workers.data.sampling import eval_micro_batches
from moetune.workers.loop.collectives import Collectives


def evaluate(engine, method, valid_set: list, micro_batch_size: int, rank: int, world: int, device,
             collectives: Collectives) -> float:
    loss_sum = count = 0.0
    engine.eval()
    with torch.no_grad():
        for indices in eval_micro_batches(len(valid_set), micro_batch_size, rank, world):
            real = [valid_set[i] for i in indices if i is not None]
            # A rank whose share ran out still runs a forward: under ZeRO-3 it is a collective.
            batch = method.collate(real or valid_set[:1]).to(device)
            loss = method.loss_sum(engine, batch)
            if real:
                loss_sum += loss.item()
                count += sum(e.loss_tokens for e in real)
    engine.train()
    loss_sum, count = collectives.all_sum(loss_sum, count)
    return loss_sum / count
