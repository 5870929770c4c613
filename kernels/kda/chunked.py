"""Chunkwise gated delta rule in plain PyTorch: all intra-chunk work batched, one short loop over chunks.

The loop over chunks (the state recurrence, two small matmuls a chunk) is an autograd.Function with its own backward
loop; the batched work around it is left to autograd. Decays inside a chunk are never formed as
exp(Γ_r)·exp(−Γ_i) (that overflows for strong gates) nor as a (C, C, K) tensor of pairwise exp(Γ_r − Γ_i) (the
largest cost on a CPU): `_decayed_products` splits the chunk in halves recursively and factors every
later-half × earlier-half block through the boundary between them, where both factors are decays (<= 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    chunk_size=64):
    """Same contract as `naive_recurrent_kda`; computes in fp32, returns o in q's dtype and an fp32 state.
    `chunk_size` must be a power of two (`_decayed_products` halves the chunk down to single tokens)."""
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if cu_seqlens is not None:
        return _packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)
    out_dtype = q.dtype
    batch, seq_len, n_heads, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    pad = (-seq_len) % chunk_size
    n_chunks = (seq_len + pad) // chunk_size

    def chunks(x):  # (B, T, H, D) -> (B, H, N, C, D); zero padding leaves the state untouched (k = β = g = 0)
        x = F.pad(x.float().transpose(1, 2), (0, 0, 0, pad))
        return x.reshape(batch, n_heads, n_chunks, chunk_size, x.shape[-1])

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))
    gamma = g.cumsum(-2)
    strict = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    kk, qk = _decayed_products((k, q), k, gamma)
    kk = kk.masked_fill(~strict, 0.0)
    # (I + Diag(β) KKᵀ_decayed) [W U] = Diag(β) [K ⊙ e^Γ, V]
    eye = torch.eye(chunk_size, device=q.device)
    rhs = beta * torch.cat([k * gamma.exp(), v], dim=-1)
    # the inverse then one matmul: cheaper on a CPU than a triangular solve against the (K + V)-wide right side
    inverse = torch.linalg.solve_triangular(eye + beta * kk, eye.expand_as(kk), upper=False, unitriangular=True)
    wu = inverse @ rhs
    w, u = wu.split([dk, dv], dim=-1)
    q_decayed = q * gamma.exp()
    last = gamma[..., -1:, :]
    k_to_end = k * (last - gamma).exp()
    state_decay = last.squeeze(-2).exp().unsqueeze(-1)
    if initial_state is None:
        initial_state = q.new_zeros(batch, n_heads, dk, dv)
    v_new, states = _ChunkScan.apply(u, w, k_to_end, state_decay, initial_state.float())
    # everything that reads the states but does not feed them runs batched over the chunks
    o = q_decayed @ states[:, :, :-1] + qk @ v_new
    o = o.reshape(batch, n_heads, n_chunks * chunk_size, dv)[:, :, :seq_len]
    return o.transpose(1, 2).to(out_dtype), (states[:, :, -1] if output_final_state else None)


class _ChunkScan(torch.autograd.Function):
    """The state recurrence over chunks n (tensors (B, H, N, ...); S_0 the initial state):
        V'_n = U_n − W_n S_n;   S_{n+1} = Diag(decay_n) S_n + K̃_nᵀ V'_n   (K̃ = K ⊙ e^{Γ_C − Γ})
    returns V' (B, H, N, C, V) and S_0..S_N (B, H, N + 1, K, V). The backward loop carries only dS; the gradients
    of U, W, K̃ and the decays are then batched matmuls over all chunks at once."""

    @staticmethod
    def forward(ctx, u, w, k_to_end, decay, initial_state):
        n_chunks = u.shape[2]
        states = u.new_empty(*initial_state.shape[:2], n_chunks + 1, *initial_state.shape[2:])
        v_new = torch.empty_like(u)
        states[:, :, 0] = initial_state
        k_t = k_to_end.transpose(-1, -2)
        for n in range(n_chunks):
            torch.sub(u[:, :, n], w[:, :, n] @ states[:, :, n], out=v_new[:, :, n])
            torch.addcmul(k_t[:, :, n] @ v_new[:, :, n], decay[:, :, n], states[:, :, n], out=states[:, :, n + 1])
        ctx.save_for_backward(w, k_to_end, decay, v_new, states)
        return v_new, states

    @staticmethod
    def backward(ctx, d_v_new, d_states):
        w, k_to_end, decay, v_new, states = ctx.saved_tensors
        n_chunks = w.shape[2]
        d_v = d_v_new.clone()  # becomes the total gradient of V'_n
        d_next = torch.empty_like(states[:, :, 1:])  # gradient reaching S_{n+1} through the recurrence
        d_state = d_states[:, :, -1]
        w_t = w.transpose(-1, -2)
        for n in reversed(range(n_chunks)):
            d_next[:, :, n] = d_state
            d_v[:, :, n] += k_to_end[:, :, n] @ d_state
            d_state = decay[:, :, n] * d_state - w_t[:, :, n] @ d_v[:, :, n] + d_states[:, :, n]
        s = states[:, :, :-1]
        d_w = -(d_v @ s.transpose(-1, -2))
        d_k_to_end = v_new @ d_next.transpose(-1, -2)
        d_decay = (d_next * s).sum(-1, keepdim=True)
        return d_v, d_w, d_k_to_end, d_decay, d_state


def _packed(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """Varlen: scatter the packed row into a zero-padded batch (padding is exact, see `chunks`), run, gather."""
    if q.shape[0] != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {q.shape[0]}")
    lengths = cu_seqlens.diff()
    n_seqs = lengths.numel()
    max_len = max(int(lengths.max()) if n_seqs else 0, 1)
    pos = torch.arange(max_len, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # (N, Tmax)
    index = (cu_seqlens[:-1, None] + pos[None, :])[valid]

    def batched(x):
        out = x.new_zeros(n_seqs, max_len, *x.shape[2:])
        out[valid] = x[0, index]
        return out

    o, final = chunk_kda_torch(*(batched(x) for x in (q, k, v, g, beta)), scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, chunk_size=chunk_size)
    return o[valid].unsqueeze(0), final


def _decayed_products(xs, y, gamma):
    *lead, size, dim = y.shape
    blocks = [(x * y).sum(-1)[..., None, None] for x in xs]  # (..., C, 1, 1): the diagonal, decay 1
    span = 1
    while span < size:
        pairs = size // (2 * span)
        gs = gamma.reshape(*lead, pairs, 2, span, dim)
        ref = gs[..., 0, -1:, :]
        y_early = y.reshape(*lead, pairs, 2, span, dim)[..., 0, :, :] * (ref - gs[..., 0, :, :]).exp()
        to_late = (gs[..., 1, :, :] - ref).exp()
        y_early_t = y_early.transpose(-1, -2)
        new = []
        for x, p in zip(xs, blocks):
            x_late = x.reshape(*lead, pairs, 2, span, dim)[..., 1, :, :] * to_late
            cross = x_late @ y_early_t
            p = p.reshape(*lead, pairs, 2, span, span)
            top = F.pad(p[..., 0, :, :], (0, span))
            bottom = torch.cat([cross, p[..., 1, :, :]], dim=-1)
            new.append(torch.cat([top, bottom], dim=-2))
        blocks = new
        span *= 2
    return [p.reshape(*lead, size, size) for p in blocks]
