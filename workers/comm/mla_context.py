"""MLA-family attention over a context-parallel group: each rank keeps its slice's queries, gathers every rank's
compressed keys (Kimi K3: the normalised latent and the shared key part, kv_lora_rank + rope numbers per token, what
the unsplit layer would cache) and attends over the row up to its own tokens.

The attention modules already pass what they would cache through `cache.update(keys, values, layer_idx)`
(transformers' cache convention; K3's MLA passes its latent and shared key there, a DSA indexer its keys through
`cache.update_indexer`), so `GatheredKeys` stands in for the cache in a CP forward and the module itself is
unchanged. The gather's backward hands each rank the sum of every rank's gradient for its own slice
(workers/comm/differentiable.all_gather): the key projections and their LoRA get the unsplit gradient once the
group's ranks sum theirs, as every parameter of a CP group does. An all-gather has one shape on every rank (NCCL's
rule, held on gloo by `checked`), so the slices are equal.

`attend_over_row` then runs one attention per sequence of the slice, its queries over that sequence's keys up to
them: causal aligned to the bottom right (kernels.attention.trailing_causal), with no mask, where a [T_slice, T]
mask would be 8 GB in fp32 for a 128K row over 8 ranks. A family whose keys carry positions (RoPE) computes them
from its slice's global positions before `update`, so the gathered keys are as the unsplit layer makes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.attention.trailing_causal import trailing_causal_attention
from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.comm.differentiable import all_gather


class GatheredKeys:
    """The cache of one CP forward: `update` returns the whole row's keys and values, every rank's slice in
    order."""

    def __init__(self, layout: SliceLayout, group=None):
        sizes = {e - b for b, e in zip(layout.bounds, layout.bounds[1:])}
        if len(sizes) != 1:
            raise ValueError(f"context-parallel slices must be equal to gather keys, got bounds {list(layout.bounds)}")
        self.layout, self.group = layout, group

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """(B, heads, T_slice, D) each → (B, heads, T, D) each."""
        return _whole_row(key_states, self.group), _whole_row(value_states, self.group)

    def update_indexer(self, states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A DSA indexer's per-token keys (B, T_slice, D) → the whole row's (B, T, D)."""
        return all_gather(states, self.group).movedim(0, 1).flatten(1, 2)


def _whole_row(x: torch.Tensor, group) -> torch.Tensor:
    return all_gather(x, group).movedim(0, 2).flatten(2, 3)  # (R, B, H, T_slice, D) → (B, H, R · T_slice, D)


def sequence_spans(layout: SliceLayout) -> list[tuple[int, int, int]]:
    """(first key, first query, end) in the row of each sequence part the slice holds: its queries [first query,
    end) see the keys [first key, end), first key where the sequence begins (an earlier rank's slice, maybe)."""
    cuts = layout.cu_seqlens or (0, layout.bounds[-1])
    return [(b, max(b, layout.start), min(e, layout.end)) for b, e in zip(cuts, cuts[1:])
            if e > layout.start and b < layout.end and e > b]


def attend_over_row(query, key, value, layout: SliceLayout, scaling: float | None = None) -> torch.Tensor:
    """query (B, H, T_slice, Dk), key (B, H, T, Dk) and value (B, H, T, Dv), the whole row's: the slice's attention
    output (B, T_slice, H, Dv), each query over its own sequence's keys up to itself."""
    width = value.shape[-1]
    if width < key.shape[-1]:  # MLA's value is narrower than its key: one width for the fused kernels
        value = F.pad(value, (0, key.shape[-1] - width))
    outs = []
    for first_key, first_query, end in sequence_spans(layout):
        q = query[:, :, first_query - layout.start:end - layout.start]
        outs.append(trailing_causal_attention(q, key[:, :, first_key:end], value[:, :, first_key:end], scaling))
    return torch.cat(outs, dim=2)[..., :width].transpose(1, 2)
