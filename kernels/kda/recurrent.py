"""The gated delta rule with per-channel decay, token by token over equal-length rows: generation's step (one new
token a row on top of each row's cached state). Every row and head moves at once; only the tokens are a loop."""

from __future__ import annotations

import torch


def recurrent_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """q, k, g: (B, T, H, K); v: (B, T, H, V); beta: (B, T, H); initial_state: (B, H, K, V). Runs in fp32 and returns
    (o in q's dtype, final state in fp32 or None): naive_recurrent_kda's results without its loop over rows."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out_dtype = q.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    batch, length, heads, dk = q.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float()
    outputs = []
    for t in range(length):
        state = state * g[:, t].exp()[..., None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, ..., None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t] * scale))
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(batch, 0, heads, v.shape[-1])
    return o.to(out_dtype), (state if output_final_state else None)
