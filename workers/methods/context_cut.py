"""A collated micro-batch cut for one context-parallel rank: every rank of a CP group collates the same examples,
pads the rows to `size` equal slices (each at least `min_tokens` long, the short convs' halo) and keeps its own
contiguous slice, with the global positions, the slice's own packed offsets, and the labels of its tokens plus the
next token's (the loss predicts each token's successor, which the next rank holds: the loss heads shift by one and
score every position that has a label after it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.methods.batch import IGNORE, PACKED_OFFSETS, Batch


def cut_for_context(batch: Batch, size: int, rank: int, pad_id: int, min_tokens: int = 1) -> tuple[Batch, SliceLayout]:
    """(this rank's part of the host batch, its slice layout). Padding carries no loss; in a packed row it is one
    more sequence, so no real sequence reads it."""
    inputs, labels = dict(batch.inputs), batch.labels
    if set(inputs) - {"input_ids", "position_ids", PACKED_OFFSETS}:
        raise ValueError(f"a context-parallel micro-batch holds token ids only, not {sorted(inputs)}")
    rows, length = labels.shape
    padded = max(-(-length // size), min_tokens) * size
    extra = padded - length
    offsets = inputs.get(PACKED_OFFSETS)
    if offsets is not None:
        if extra:
            offsets = torch.cat([offsets, offsets.new_tensor([padded])])
        layout = SliceLayout.even(padded, size, rank, offsets.tolist())
    else:
        layout = SliceLayout.even(padded, size, rank)
    positions = inputs.get("position_ids", torch.arange(length).expand(rows, -1))
    inputs["input_ids"] = F.pad(inputs["input_ids"], (0, extra), value=pad_id)
    pad_positions = torch.arange(extra) + (0 if offsets is not None else length)  # a sequence of its own, or on
    inputs["position_ids"] = torch.cat([positions, pad_positions.expand(rows, -1)], dim=1)
    mine = slice(layout.start, layout.end)
    part = {name: inputs[name][:, mine] for name in ("input_ids", "position_ids")}
    if offsets is not None:
        part[PACKED_OFFSETS] = torch.tensor(layout.local_offsets)
    labels = F.pad(labels, (0, extra + 1), value=IGNORE)[:, layout.start:layout.end + 1]
    return Batch(part, labels, batch.tokens), layout
