"""Context parallelism in the step: this rank's CP group, its part of each micro-batch and the forward it runs in.

Every rank of a CP group collates the same examples (the data-parallel index picks them); each keeps its slice
(methods.context_cut) and runs the model's forward and backward on it inside workers.families.context. Each rank's
loss sums its own slice's tokens, so the step's scaling (world / the global batch's loss tokens, under DeepSpeed's
mean over the ranks) still makes the gradient the global token mean."""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from moetune.api.models.parallelism import ParallelDims
from moetune.workers.families.context import context_parallel, min_slice_tokens
from moetune.workers.methods.batch import Batch
from moetune.workers.methods.context_cut import cut_for_context


class ContextSplit:
    def __init__(self, model, dims: ParallelDims, world_rank: int, pad_id: int):
        """Makes every CP group of the layout (each rank makes them all, in one order, as torch.distributed
        requires) and keeps this rank's."""
        self.model, self.size, self.pad_id = model, dims.context_parallel_size, pad_id
        self.rank = dims.coordinates(world_rank).context_rank
        self.min_tokens = min_slice_tokens(model)
        mine = dims.context_group_ranks(world_rank)
        for first in range(0, dims.num_workers, self.size):
            group = dist.new_group(dims.context_group_ranks(first))
            if first == mine[0]:
                self.group = group

    @contextmanager
    def running(self, batch: Batch, device):
        """This rank's part of the host micro-batch, on `device`; its forward and backward go inside."""
        part, layout = cut_for_context(batch, self.size, self.rank, self.pad_id, self.min_tokens)
        with context_parallel(self.model, layout, self.group):
            yield part.to(device)
