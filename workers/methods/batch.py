"""What a training method hands the step: a micro-batch whose model inputs flow unchanged into `model(**inputs)`."""

from __future__ import annotations

from dataclasses import dataclass

IGNORE = -100  # label of tokens that carry no loss (prompt turns, padding)
PACKED_OFFSETS = "cu_seq_lens_q"  # where each packed sequence starts (workers.families.segments), and the end


@dataclass
class Batch:
    inputs: dict  # tensors the model is called with: input_ids, attention_mask, and whatever a method adds
    # [B, T] token ids, IGNORE where no loss is taken (the loss shifts them by one); [B, T + 1] for a
    # context-parallel slice (methods.context_cut: its last token's target is the next rank's first token)
    labels: object
    tokens: int  # real (non-padding) tokens, for throughput

    def to(self, device) -> Batch:
        """On `device`; packed-sequence offsets as every layer takes them (kernels.kda.packed_offsets: made once
        per micro-batch, with their host copy, so no layer reads them back)."""
        from moetune.kernels.kda import packed_offsets

        inputs = {k: packed_offsets(v, device) if k == PACKED_OFFSETS else v.to(device) for k, v in self.inputs.items()}
        return Batch(inputs, self.labels.to(device), self.tokens)
