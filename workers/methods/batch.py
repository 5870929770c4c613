"""What a training method hands the step: a micro-batch whose model inputs flow unchanged into `model(**inputs)`."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE = -100  # label of tokens that carry no loss (prompt turns, padding)


@dataclass
class Batch:
    inputs: dict  # tensors the model is called with: input_ids, attention_mask, and whatever a method adds
    labels: object  # [B, T] token ids, IGNORE where no loss is taken (the loss shifts them by one)
    tokens: int  # real (non-padding) tokens, for throughput

    def to(self, device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.inputs.items()}, self.labels.to(device), self.tokens)
