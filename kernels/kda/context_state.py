"""KDA / Gated DeltaNet context parallelism's local math on moetune's own kernels (CPU, and CUDA wherever fla's
`cp_context` cannot serve): what a rank's slice hands on, the state it starts from, and its run from there.

The recurrence S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ is affine in the state, so a slice maps
the state S at its start to M S + F: M (K, K) the product of its tokens' transitions, F its final state from zero.
One kernel run gives both: from the initial state [I | 0] with values [0 | v] no column mixes with another, so the
final state is [M | F]. Each rank summarises its last sequence this way, the ranks all-gather the summaries
(workers/comm/kda_context.py, fla's approach: one gather of small per-rank summaries, no chain of sends), and a slice
whose first sequence began on rank j < r starts from M_{r−1}(…(M_j S_0 + F_j)…) + F_{r−1}. Everything is plain
autograd, so gradients reach k, v, g, β and the initial state through the summaries.

`kda` is any implementation with chunk_kda_torch's contract (chunk_kda_torch, naive_recurrent_kda, the Triton one).
Gated DeltaNet runs as KDA with one gate channel (see kernels.kda._on_kda).
"""

from __future__ import annotations

import torch

from .chunked import chunk_kda_torch
from .context_slices import SliceLayout


def slice_summary(k, v, g, beta, layout: SliceLayout, kda=chunk_kda_torch) -> torch.Tensor:
    """[M | F] (B, H, K, K + V) fp32 of the slice's last sequence (B rows without packing, one with). Computed on
    every rank, also where no later slice continues it: every rank then takes part in the gather's backward."""
    start = layout.last_segment_start
    k, v, g, beta = (x[:, start:] for x in (k, v, g, beta))
    batch, _, heads, dk = k.shape
    identity = torch.eye(dk, dtype=torch.float32, device=k.device).expand(batch, heads, dk, dk)
    from_identity = torch.cat([identity, identity.new_zeros(batch, heads, dk, v.shape[-1])], dim=-1)
    values = torch.cat([v.new_zeros(*v.shape[:-1], dk), v], dim=-1)
    _, final = kda(k, k, values, g, beta, initial_state=from_identity, output_final_state=True)
    return final


def slice_initial_state(summaries: torch.Tensor, layout: SliceLayout, initial_state=None) -> torch.Tensor | None:
    """The initial states of the slice's sequences ((B or local sequences), H, K, V fp32; None where all are zero):
    `initial_state` (the unsplit call's, one per row or packed sequence) for sequences that begin in this slice, and
    for the first one, where it began on an earlier rank, that state carried through those ranks' `summaries`
    (R, B, H, K, K + V: every rank's slice_summary, in rank order). Each rank reads `initial_state` itself: the
    caller sums its gradient over the CP group."""
    source = layout.carried_from
    if initial_state is None and source is None:
        return None
    batch, heads, dk = summaries.shape[1:4]
    dv = summaries.shape[-1] - dk
    count = batch if layout.cu_seqlens is None else len(layout.local_offsets) - 1
    first = layout.first_sequence
    if initial_state is None:
        states = summaries.new_zeros(count, heads, dk, dv)
    else:
        states = initial_state[first:first + count].float()
    if source is None:
        return states
    carried = states[:batch]
    for summary in summaries[source:layout.rank]:
        transition, final = summary.split([dk, dv], dim=-1)
        carried = transition @ carried + final
    return torch.cat([carried, states[batch:]])


def run_slice(q, k, v, g, beta, layout: SliceLayout, initial_state=None, scale=None, kda=chunk_kda_torch):
    """The slice's output (B, T_slice, H, V) in q's dtype, from slice_initial_state's states."""
    offsets = layout.local_offsets
    cu_seqlens = None if offsets is None else torch.tensor(offsets, dtype=torch.long, device=q.device)
    o, _ = kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens)
    return o.to(q.dtype)
