"""KDA / Gated DeltaNet over a context-parallel group on moetune's own kernels (CPU, and CUDA wherever fla's
`cp_context` cannot serve): each rank summarises its slice (kernels.kda.context_state), one differentiable
all-gather shares the summaries, and each rank runs its slice from the state carried into it. The KDA swap's core
calls it in a CP forward (workers/families/context.py); fla's cp_context on CUDA is not wired yet."""

from __future__ import annotations

import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from moetune.kernels.kda.chunked import chunk_kda_torch
from moetune.kernels.kda.context_slices import SliceLayout
from moetune.kernels.kda.context_state import run_slice, slice_initial_state, slice_summary
from moetune.workers.comm.differentiable import all_gather, entangled


def context_parallel_kda(q, k, v, g, beta, layout: SliceLayout, group=None, scale=None, initial_state=None,
                         kda=chunk_kda_torch):
    """This rank's slice of the unsplit kda(q, k, v, g, β, initial_state, cu_seqlens=layout.cu_seqlens) output
    (B, T_slice, H, V) in q's dtype. `initial_state` (every row's or packed sequence's, the same on every rank):
    each rank's gradient for it is partial, the caller sums it over `group`. Every rank must backpropagate."""
    if (layout.world, layout.rank) != (dist.get_world_size(group), dist.get_rank(group)):
        raise ValueError(f"slice layout of rank {layout.rank} of {layout.world} on rank {dist.get_rank(group)} of "
                         f"a {dist.get_world_size(group)}-rank CP group")
    # The summary's kernel run is as wide as the state (K + V values): kept for the backward it would save more than
    # the slice's own run. It is recomputed there instead, from the inputs that run keeps anyway.
    summary = checkpoint(slice_summary, k, v, g, beta, layout, kda, use_reentrant=False)
    summaries = all_gather(summary, group)
    state = slice_initial_state(summaries, layout, initial_state)
    o = run_slice(q, k, v, g, beta, layout, state, scale, kda)
    return o if layout.carried_from is not None else entangled(o, summaries)
