"""The model's output layer, which, while a micro-batch's labels are armed, returns that micro-batch's summed
next-token cross-entropy instead of logits (kernels.loss: no [tokens, vocab] tensor), and only over the positions
that carry loss. It runs inside the model's forward, where ZeRO-3 has gathered its weight; unarmed (evaluation
harnesses, generation) it is the plain linear."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from moetune.kernels.loss import linear_cross_entropy_sum
from moetune.workers.methods.batch import IGNORE


class LossHead(torch.nn.Module):
    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.weight = head.weight  # the same Parameter: a tie to the input embeddings stays
        self.labels = None

    def forward(self, hidden):
        if self.labels is None:
            return F.linear(hidden, self.weight)
        targets = self.labels[:, 1:].flatten()  # the model shifts nothing here: position t predicts label t+1
        keep = targets != IGNORE
        return linear_cross_entropy_sum(hidden[:, :-1].flatten(0, 1)[keep], self.weight, targets[keep])

    @contextlib.contextmanager
    def armed(self, labels):
        self.labels = labels
        try:
            yield
        finally:
            self.labels = None


def install_loss_head(model, head_class: type[LossHead] = LossHead) -> LossHead | None:
    """Replaces a transformers model's (PEFT-wrapped too) bias-free output linear by a LossHead (or the method's
    subclass of it); None when it has another output layer (the loss then takes the logits)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    name = next(n for n, m in model.named_modules() if m is head)
    parent, _, leaf = name.rpartition(".")
    loss_head = head_class(head)
    setattr(model.get_submodule(parent), leaf, loss_head)
    return loss_head
