"""The short causal convolution over a context-parallel group: a rank's first tokens read the previous rank's last
`width − 1` inputs (its halo). One differentiable all-gather of every rank's last inputs (the backward returns each
halo's gradient to its owner); fla's CP conv sends them point to point instead, on CUDA.

The KDA swap's short conv prepends `previous_tokens` to its slice's inputs in a CP forward
(workers/families/context.py)."""

from __future__ import annotations

import torch

from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.comm.differentiable import all_gather


def previous_tokens(x: torch.Tensor, width: int, layout: SliceLayout, group=None) -> torch.Tensor:
    """x (B, T_slice, D): this rank's conv inputs. Returns (B, width − 1, D): the tokens before the slice, zero where
    they precede its first sequence (rank 0, a sequence starting at or just before the cut)."""
    halo = width - 1
    if halo == 0:
        return x[:, :0]
    if min(e - b for b, e in zip(layout.bounds, layout.bounds[1:])) < halo:
        raise ValueError(f"a width-{width} conv needs CP slices of at least {halo} tokens, got bounds "
                         f"{list(layout.bounds)}")
    parts = all_gather(x[:, -halo:], group)
    positions = torch.arange(layout.start - halo, layout.start, device=x.device)
    ours = (positions >= layout.first_sequence_start)[:, None]  # tokens of the slice's first sequence
    return torch.where(ours, parts[layout.rank - 1], 0)
