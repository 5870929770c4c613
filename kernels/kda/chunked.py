"""Chunkwise gated delta rule in plain PyTorch: all intra-chunk work batched, one short loop over chunks.

The loop over chunks (the state recurrence, two small matmuls a chunk) is an autograd.Function with its own backward
loop; the batched work around it is left to autograd. Decays inside a chunk are never formed as
exp(Γ_r)·exp(−Γ_i) (that overflows for strong gates) nor as a (C, C, K) tensor of pairwise exp(Γ_r − Γ_i) (the
largest cost on a CPU): `_DecayedProducts` splits the chunk in halves recursively and factors every
later-half × earlier-half block through the boundary between them, where both factors are decays (<= 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_kda_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                    chunk_size=None):
    """Same contract as `naive_recurrent_kda`; computes in fp32, returns o in q's dtype and an fp32 state. g may
    also be (B, T, H, 1): one decay per head, broadcast over K (Gated DeltaNet), whose pairwise decays within a chunk
    are a plain (C, C) matrix. `chunk_size` must be a power of two (`_DecayedProducts` halves the chunk down to
    single tokens); by default the head width's power of two within [16, 64] (`default_chunk_size`)."""
    chunk_size = chunk_size or default_chunk_size(q.shape[-1], v.shape[-1])
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

    def chunks(x):  # (B, T, H, D) -> (N, B, H, C, D); zero padding leaves the state untouched (k = β = g = 0)
        x = F.pad(x.float(), (0, 0, 0, 0, 0, pad)).unflatten(1, (n_chunks, chunk_size))
        return x.permute(1, 0, 3, 2, 4).contiguous()  # chunk-major: each chunk's (B, H, ...) slice is contiguous

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))
    gamma = g.cumsum(-2)
    strict = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril(-1)
    kk, qk = _decayed_products(k, q, gamma)
    kk = kk.masked_fill(~strict, 0.0)
    # (I + Diag(β) KKᵀ_decayed) [W U] = Diag(β) [K ⊙ e^Γ, V]
    decay_in = gamma.exp()  # from the chunk start, <= 1
    rhs = beta * torch.cat([k * decay_in, v], dim=-1)
    # the inverse then one matmul: cheaper on a CPU than a triangular solve against the (K + V)-wide right side
    wu = _UnitLowerInverse.apply(beta * kk) @ rhs
    w, u = wu.split([dk, dv], dim=-1)
    q_decayed = q * decay_in
    last = gamma[..., -1:, :]
    k_to_end = k * (last - gamma).exp()
    state_decay = last.squeeze(-2).exp().unsqueeze(-1)
    if initial_state is None:
        initial_state = q.new_zeros(batch, n_heads, dk, dv)
    v_new, states = _ChunkScan.apply(u, w, k_to_end, state_decay, initial_state.float())
    # everything that reads the states but does not feed them runs batched over the chunks
    o = q_decayed @ states[:-1] + qk @ v_new
    o = o.permute(1, 0, 3, 2, 4).reshape(batch, n_chunks * chunk_size, n_heads, dv)[:, :seq_len]
    return o.to(out_dtype), (states[-1] if output_final_state else None)


def default_chunk_size(dk: int, dv: int) -> int:
    """A chunk's work grows as C² (K + V) + C³ (its pairwise products and inverse), the scan's as K·V per chunk:
    narrow heads want short chunks. fwd+bwd on one CPU thread, one gate a head: K = V = 16 (B=32, T=200) takes
    153 / 242 / 545 ms at C = 16 / 32 / 64; K = V = 128 (B=2, T=1024) 1303 / 792 / 745 ms."""
    return min(64, max(16, 1 << (max(dk, dv) - 1).bit_length()))


class _ChunkScan(torch.autograd.Function):
    """The state recurrence over chunks n (tensors (N, B, H, ...); S_0 the initial state (B, H, K, V)):
        V'_n = U_n − W_n S_n;   S_{n+1} = Diag(decay_n) S_n + K̃_nᵀ V'_n   (K̃ = K ⊙ e^{Γ_C − Γ})
    returns V' (N, B, H, C, V) and S_0..S_N (N + 1, B, H, K, V). The backward loop carries only dS; the gradients
    of U, W, K̃ and the decays are then batched matmuls over all chunks at once. Chunk-major buffers keep every
    baddbmm's result contiguous: PyTorch's CPU baddbmm into a strided `out` (above ~400 multiply-adds) runs one
    GEMM per batch entry plus copies, 5.8x slower at B·H = 128, C = K = V = 16 than MKL's batched call."""

    @staticmethod
    def forward(ctx, u, w, k_to_end, decay, initial_state):
        states = u.new_empty(u.shape[0] + 1, *initial_state.shape)
        v_new = torch.empty_like(u, memory_format=torch.contiguous_format)
        states[0] = initial_state
        steps = zip(*(_per_chunk(x) for x in (u, w, k_to_end.transpose(-1, -2), decay, v_new, states[:-1],
                                             states[1:])))
        for u_n, w_n, k_t_n, decay_n, v_n, s_n, s_next in steps:  # two fused ops a chunk
            torch.baddbmm(u_n, w_n, s_n, alpha=-1, out=v_n)
            torch.baddbmm(decay_n * s_n, k_t_n, v_n, out=s_next)
        ctx.save_for_backward(w, k_to_end, decay, v_new, states)
        return v_new, states

    @staticmethod
    def backward(ctx, d_v_new, d_states):
        w, k_to_end, decay, v_new, states = ctx.saved_tensors
        d_v = d_v_new.clone(memory_format=torch.contiguous_format)  # becomes the total gradient of V'_n
        d_next = states.new_empty(states[1:].shape)  # gradient reaching S_{n+1} through the recurrence
        d_next[-1] = d_states[-1]
        d_initial = torch.empty_like(d_next[0])
        steps = list(zip(*(_per_chunk(x) for x in (d_v, k_to_end, w.transpose(-1, -2), decay, d_states[:-1],
                                                   d_next))))
        targets = [d_initial.flatten(0, 1), *_per_chunk(d_next)[:-1]]  # where dS_n goes
        for (d_v_n, k_n, w_t_n, decay_n, d_out_n, d_next_n), d_state_n in zip(reversed(steps), reversed(targets)):
            d_v_n.baddbmm_(k_n, d_next_n)
            torch.baddbmm(torch.addcmul(d_out_n, decay_n, d_next_n), w_t_n, d_v_n, alpha=-1, out=d_state_n)
        s = states[:-1]
        d_w = -(d_v @ s.transpose(-1, -2))
        d_k_to_end = v_new @ d_next.transpose(-1, -2)
        d_decay = (d_next * s).sum(-1, keepdim=True).sum_to_size(decay.shape)  # one gate a head: summed over K
        return d_v, d_w, d_k_to_end, d_decay, d_initial


def _per_chunk(x):
    """(N, B, H, ...) -> N tensors (B·H, ...), views where x allows (always for the buffers written in place)."""
    return x.flatten(1, 2).unbind(0)


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


def _decayed_products(k, q, gamma):
    """P[r, i] = Σ_d x_r[d] k_i[d] e^{Γ_r[d] − Γ_i[d]} for i <= r, else 0, for x = k and x = q (see
    _DecayedProducts); with one gate channel the decays leave the sum: (X Kᵀ) ⊙ e^{Γ_r − Γ_i}, every exponent <= 0
    where it is kept, both products one matmul of [K; Q] (2C rows) against Kᵀ."""
    if gamma.shape[-1] > 1:
        return _DecayedProducts.apply(torch.stack([k, q]), k, gamma)
    size = gamma.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=gamma.device).tril()
    exponents = (gamma - gamma.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
    products = torch.cat([k, q], dim=-2) @ k.transpose(-1, -2)
    return (products.unflatten(-2, (2, size)) * exponents.exp().unsqueeze(-3)).unbind(-3)


class _UnitLowerInverse(torch.autograd.Function):
    """(I + A)⁻¹ for A (..., C, C) strictly lower triangular. The backward reuses the inverse X: dA = −Xᵀ dX Xᵀ
    below the diagonal, two batched matmuls where autograd through solve_triangular solves again."""

    @staticmethod
    def forward(ctx, a):
        eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        inverse = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    def backward(ctx, d_inverse):
        (inverse,) = ctx.saved_tensors
        inverse_t = inverse.transpose(-1, -2)
        return (inverse_t @ d_inverse @ inverse_t).tril_(-1).neg_()


class _DecayedProducts(torch.autograd.Function):
    """xs (n, ..., C, D), y and Γ (..., C, D) -> P (n, ..., C, C): P[r, i] = Σ_d x_r[d] y_i[d] e^{Γ_r[d] − Γ_i[d]} for
    i <= r, else 0; C a power of two.

    Level by level (span 1, 2, 4, ...), the chunk is cut into pairs of adjacent spans; the block of rows in the later
    span and columns in the earlier one is (x ⊙ e^{Γ − ref}) (y ⊙ e^{ref − Γ})ᵀ, ref = Γ at the end of the earlier
    span: both factors are <= 1, so nothing overflows, and each level touches every token once (O(C·D) decays per
    level instead of O(C²·D) pairwise). The diagonal has decay 1. The backward recomputes the decays."""

    @staticmethod
    def forward(ctx, xs, y, gamma):
        size = y.shape[-2]
        out = xs.new_zeros(*xs.shape[:-1], size)
        out.diagonal(dim1=-2, dim2=-1).copy_((xs * y).sum(-1))
        for span in _spans(size):
            early, late = _boundary_decays(gamma, span)
            y_early = _half(y, span, 0) * early
            _cross_block(out, span).copy_((_half(xs, span, 1) * late) @ y_early.transpose(-1, -2))
        ctx.save_for_backward(xs, y, gamma)
        return out

    @staticmethod
    def backward(ctx, d_out):
        xs, y, gamma = ctx.saved_tensors
        d_out = d_out.contiguous()
        d_diag = d_out.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)
        d_xs = d_diag * y
        d_y = (d_diag * xs).sum(0)
        d_gamma = torch.zeros_like(gamma)
        for span in _spans(y.shape[-2]):
            early, late = _boundary_decays(gamma, span)
            y_early = _half(y, span, 0) * early
            x_late = _half(xs, span, 1) * late
            d_cross = _cross_block(d_out, span)
            d_x_late = d_cross @ y_early
            d_y_early = (d_cross.transpose(-1, -2) @ x_late).sum(0)
            _half(d_xs, span, 1).addcmul_(d_x_late, late)
            _half(d_y, span, 0).addcmul_(d_y_early, early)
            # gradients of the exponents Γ_late − ref and ref − Γ_early; ref is Γ at the earlier span's last token
            d_late = (d_x_late * x_late).sum(0)
            d_early = d_y_early * y_early
            _half(d_gamma, span, 1).add_(d_late)
            d_gamma_early = _half(d_gamma, span, 0)
            d_gamma_early.sub_(d_early)
            d_gamma_early[..., -1, :] += d_early.sum(-2) - d_late.sum(-2)
        return d_xs, d_y, d_gamma


def _spans(size):
    span = 1
    while span < size:
        yield span
        span *= 2


def _half(x, span, which):
    """(..., C, D) -> (..., C / 2span, span, D): the earlier (0) or later (1) span of every pair, as a view."""
    return x.unflatten(-2, (-1, 2, span))[..., which, :, :]


def _boundary_decays(gamma, span):
    """e^{ref − Γ} over the earlier spans and e^{Γ − ref} over the later ones, ref = Γ at the end of the earlier."""
    ref = _half(gamma, span, 0)[..., -1:, :]
    return (ref - _half(gamma, span, 0)).exp(), (_half(gamma, span, 1) - ref).exp()


def _cross_block(p, span):
    """(..., C, C) -> (..., C / 2span, span, span): rows in the later span, columns in the earlier, as a view."""
    pairs = p.shape[-1] // (2 * span)
    blocks = p.unflatten(-1, (pairs, 2 * span)).unflatten(-3, (pairs, 2 * span)).diagonal(dim1=-4, dim2=-2)
    return blocks[..., span:, :span, :].movedim(-1, -3)
