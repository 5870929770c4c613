"""Token-by-token gated delta rule with per-channel decay: the oracle every faster path is tested against."""

from __future__ import annotations

import torch


def naive_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """q, k, g: (B, T, H, K); v: (B, T, H, V); beta: (B, T, H); initial_state: (N, H, K, V) with N = B,
    or the number of sequences when `cu_seqlens` (B must be 1) packs several into one row.
    Runs in fp32 and returns (o in q's dtype, final state in fp32 or None). Differentiable by autograd."""
    if cu_seqlens is None:
        bounds = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    n_heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    rows = [[] for _ in range(q.shape[0])]
    finals = []
    for n, (b, bos, eos) in enumerate(bounds):
        if initial_state is None:
            state = q.new_zeros(n_heads, dk, dv)
        else:
            state = initial_state[n].float()
        for t in range(bos, eos):
            state = state * g[b, t].exp()[..., None]
            predicted = torch.einsum("hkv,hk->hv", state, k[b, t])
            delta = beta[b, t][:, None] * (v[b, t] - predicted)
            state = state + k[b, t][..., None] * delta[:, None, :]
            rows[b].append(torch.einsum("hkv,hk->hv", state, q[b, t] * scale))
        finals.append(state)
    o = torch.stack([torch.stack(r) if r else v.new_zeros(0, n_heads, dv) for r in rows])
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)
