"""Chunkwise gated delta rule in plain PyTorch: all intra-chunk work batched, one short loop over chunks.

Backward comes from autograd. Decays inside a chunk are never formed as exp(Γ_r)·exp(−Γ_i) over the whole chunk
(that overflows for strong gates): blocks between 16-token sub-chunks factor through the end of the earlier
sub-chunk, where both factors are decays (<= 1), and only the 16×16 diagonal blocks take exp(Γ_r − Γ_i) pairwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    chunk_size=64):
    """Same contract as `naive_recurrent_kda`; computes in fp32, returns o in q's dtype and an fp32 state.
    `chunk_size` must be a multiple of 16 (the sub-chunk of `_decayed_products`)."""
    if chunk_size % 16:
        raise ValueError(f"chunk_size must be a multiple of 16, got {chunk_size}")
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
        state = q.new_zeros(batch, n_heads, dk, dv)
    else:
        state = initial_state.float()
    outs = []
    # unbind once: indexing chunk n inside the loop would make autograd allocate a full-size zero grad per chunk
    per_chunk = zip(*(x.unbind(2) for x in (u, w, q_decayed, qk, state_decay, k_to_end.transpose(-1, -2))))
    for u_n, w_n, q_n, qk_n, decay_n, k_t_n in per_chunk:
        v_new = u_n - w_n @ state
        outs.append(q_n @ state + qk_n @ v_new)
        state = decay_n * state + k_t_n @ v_new
    o = torch.stack(outs, dim=2).reshape(batch, n_heads, n_chunks * chunk_size, dv)[:, :, :seq_len]
    return o.transpose(1, 2).to(out_dtype), (state if output_final_state else None)


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


def _decayed_products(xs, y, gamma, sub=16):
    """For each x in xs: P[r, i] = Σ_d x_r[d] y_i[d] exp(Γ_r[d] − Γ_i[d]) for i <= r, else 0.

    Inputs (..., C, D) with C a multiple of `sub`; the decays are computed once and shared by all xs."""
    *lead, size, dim = y.shape
    n_sub = size // sub
    ys, gs = (t.reshape(*lead, n_sub, sub, dim) for t in (y, gamma))
    xs = torch.stack([x.reshape(*lead, n_sub, sub, dim) for x in xs], dim=-1)  # (..., S, c, D, n_x)
    # Diagonal blocks, pairwise: decay[a, r, i, d], the upper triangle set to -inf before exp.
    causal = torch.ones(sub, sub, dtype=torch.bool, device=y.device).tril()
    # (in place where autograd allows: these are the largest tensors of the whole computation)
    decay = (gs.unsqueeze(-2) - gs.unsqueeze(-3)).masked_fill_(~causal[..., None], float("-inf")).exp_()
    diag = (ys.unsqueeze(-3) * decay) @ xs  # (..., S, c_r, c_i, n_x)
    # Blocks a > b: x_a e^{Γ_a − ref_b} @ (y_b e^{ref_b − Γ_b})ᵀ with ref_b = Γ at the end of sub-chunk b.
    ref = gs[..., -1, :]  # (..., S, D)
    later = torch.ones(n_sub, n_sub, dtype=torch.bool, device=y.device).tril(-1)
    decay_to_ref = (gs.unsqueeze(-3) - ref[..., None, :, None, :]).masked_fill_(
        ~later[..., None, None], float("-inf")).exp_()  # (..., S_a, S_b, c, D)
    y_scaled = ys * (ref.unsqueeze(-2) - gs).exp()  # (..., S_b, c, D)
    eye = torch.eye(n_sub, device=y.device)[..., None, None]
    products = []
    for n in range(xs.shape[-1]):
        blocks = (xs[..., n].unsqueeze(-3) * decay_to_ref) @ y_scaled.unsqueeze(-4).transpose(-1, -2)
        blocks = blocks + diag[..., n].unsqueeze(-3) * eye  # (..., S_a, S_b, c, c)
        products.append(blocks.transpose(-3, -2).reshape(*lead, size, size))
    return products
