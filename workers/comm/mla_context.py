"""MLA-family attention over a context-parallel group: each rank keeps its slice's queries, gathers every rank's
compressed keys (Kimi K3: the normalised latent and the shared key part, kv_lora_rank + rope numbers per token, what
the unsplit layer would cache) and attends over the row up to its own tokens.

The attention modules already pass what they would cache through `cache.update(keys, values, layer_idx)`
(transformers' cache convention; K3's MLA passes its latent and shared key there), so `GatheredKeys` stands in for
the cache in a CP forward and the module itself is unchanged. The gather's backward hands each rank the sum of
every rank's gradient for its own slice (workers/comm/differentiable.all_gather): the key projections and their LoRA
get the unsplit gradient once the group's ranks sum theirs, as every parameter of a CP group does. An all-gather has
one shape on every rank (NCCL's rule, held on gloo by `checked`), so the slices are equal.

A family whose keys carry positions (RoPE) computes them from its slice's global positions before `update`, so the
gathered keys are as the unsplit layer makes them."""

from __future__ import annotations

import torch

from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.comm.differentiable import all_gather


class GatheredKeys:
    """The cache of one CP forward: `update` returns the whole row's keys and values, every rank's slice in order,
    for this rank's queries, which `slice_attention_mask` then keeps causal."""

    def __init__(self, layout: SliceLayout, group=None):
        sizes = {e - b for b, e in zip(layout.bounds, layout.bounds[1:])}
        if len(sizes) != 1:
            raise ValueError(f"context-parallel slices must be equal to gather keys, got bounds {list(layout.bounds)}")
        self.layout, self.group = layout, group

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """(B, heads, T_slice, D) each → (B, heads, T, D) each."""
        return _whole_row(key_states, self.group), _whole_row(value_states, self.group)


def _whole_row(x: torch.Tensor, group) -> torch.Tensor:
    return all_gather(x, group).movedim(0, 2).flatten(2, 3)  # (R, B, H, T_slice, D) → (B, H, R · T_slice, D)


def slice_attention_mask(layout: SliceLayout, dtype: torch.dtype, device=None) -> torch.Tensor:
    """(1, 1, T_slice, T) additive mask (0 where seen, the dtype's lowest value elsewhere) for the slice's queries
    over the whole row's keys: causal at the slice's place in the row and, with packed sequences, within each one."""
    queries = torch.arange(layout.start, layout.end, device=device)[:, None]
    keys = torch.arange(layout.bounds[-1], device=device)[None, :]
    seen = keys <= queries
    if layout.cu_seqlens is not None:
        cuts = torch.tensor(layout.cu_seqlens[1:-1], device=device)
        seen &= torch.bucketize(keys, cuts, right=True) == torch.bucketize(queries, cuts, right=True)
    mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, torch.finfo(dtype).min)
    return mask[None, None]
