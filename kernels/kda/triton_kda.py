"""Triton kernels for the chunkwise gated delta rule (forward and backward), packed-sequence native.

The CUDA path runs fla's chunk-parallel kernels (kernels/kda/__init__.py); these serve only where fla cannot: a
CUDA machine without fla installed, or MOETUNE_KDA_KERNEL=moetune. One program per (sequence, head) walks its
chunks in order, so a few long sequences leave most SMs idle, and the backward holds whole [K, V] states per
program (255 registers with spills at K = V = 128).

Every launch works on a packed row: sequence n spans tokens [cu_seqlens[n], cu_seqlens[n+1]) of a (1, T, H, D)
layout, a plain batch being the special case of equal lengths. Chunks of BT tokens start at each sequence's first
token; a partial last chunk is loaded with zeros, which leaves the state untouched (k = β = g = 0).

Per chunk, exactly as in kernels/kda/chunked.py: Γ = cumsum(g); A[r, i] = β_r Σ_d k_r k_i e^{Γ_r − Γ_i} (i < r);
M = (I + A)^{-1}; T = M Diag(β); W = T (K ⊙ e^Γ); U = T V; V' = U − W S; O = (sQ ⊙ e^Γ) S + Aqk V';
S ← e^{Γ_last} ⊙ S + (K ⊙ e^{Γ_last − Γ})ᵀ V'. Pairwise decays come column by column as exp(Γ_r − Γ_j) (never a
product that can overflow). The forward stores the state at every chunk start; the backward walks the chunks in
reverse, recomputes the chunk from that state and carries dS. Tiles are fp32 inside the kernel, also because bf16
`tl.dot` is wrong under TRITON_INTERPRET.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32


@triton.jit
def _row(x, rows, j):
    """Row j of a (BT, D) tile as a (D,) vector."""
    return tl.sum(tl.where(rows[:, None] == j, x, 0.0), axis=0)


@triton.jit
def _col(x, rows, j):
    """Column j of a (BT, BT) tile as a (BT,) vector."""
    return tl.sum(tl.where(rows[None, :] == j, x, 0.0), axis=1)


@triton.jit
def _chunk_pairs(q, k, gam, rows, BT: tl.constexpr, BK: tl.constexpr):
    """Ã[r, i] = Σ_d k_r k_i e^{Γ_r − Γ_i} (i < r) and Aqk[r, i] = Σ_d q_r k_i e^{Γ_r − Γ_i} (i <= r)."""
    akk = tl.zeros((BT, BT), dtype=tl.float32)
    aqk = tl.zeros((BT, BT), dtype=tl.float32)
    for j in range(BT):
        k_j = _row(k, rows, j)
        g_j = _row(gam, rows, j)
        decay = tl.exp(tl.where(rows[:, None] >= j, gam - g_j[None, :], float("-inf")))
        kd_j = k_j[None, :] * decay
        on_col = rows[None, :] == j
        akk = tl.where(on_col, tl.sum(k * kd_j, axis=1)[:, None], akk)
        aqk = tl.where(on_col, tl.sum(q * kd_j, axis=1)[:, None], aqk)
    akk = tl.where(rows[:, None] > rows[None, :], akk, 0.0)
    return akk, aqk


@triton.jit
def _unit_lower_inverse(a, rows, BT: tl.constexpr):
    """(I + A)^{-1} for strictly lower-triangular A by forward substitution, one row at a time."""
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    inv = eye
    for r in range(1, BT):
        a_r = _row(a, rows, r)
        row = _row(eye, rows, r) - tl.sum(a_r[:, None] * inv, axis=0)
        inv = tl.where(rows[:, None] == r, row[None, :], inv)
    return inv


@triton.jit
def _load_chunk(ptr, t, valid, width, cols, col_mask, H, i_h):
    offs = (t[:, None] * H + i_h) * width + cols[None, :]
    return tl.load(ptr + offs, mask=valid[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _chunk_forward(q, k, v, g, beta, state, t, valid, rows, rk, rv, mk, mv, scale, H, i_h,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Loads one chunk and runs it forward from `state` (shared by the forward and the backward's recompute)."""
    q_c = _load_chunk(q, t, valid, K, rk, mk, H, i_h) * scale
    k_c = _load_chunk(k, t, valid, K, rk, mk, H, i_h)
    g_c = _load_chunk(g, t, valid, K, rk, mk, H, i_h)
    v_c = _load_chunk(v, t, valid, V, rv, mv, H, i_h)
    b_c = tl.load(beta + t * H + i_h, mask=valid, other=0.0).to(tl.float32)
    gam = tl.cumsum(g_c, axis=0)
    g_last = _row(gam, rows, BT - 1)
    akk, aqk = _chunk_pairs(q_c, k_c, gam, rows, BT, BK)
    inv = _unit_lower_inverse(akk * b_c[:, None], rows, BT)
    t_mat = inv * b_c[None, :]
    w = tl.dot(t_mat, k_c * tl.exp(gam))
    v_new = tl.dot(t_mat, v_c) - tl.dot(w, state)
    k_to_end = k_c * tl.exp(g_last[None, :] - gam)
    return q_c, k_c, v_c, b_c, gam, g_last, akk, aqk, inv, t_mat, w, v_new, k_to_end


@triton.jit
def _sequence(cu_seqlens, chunk_offsets, i_nh, H):
    """(sequence, head, first token, end token, index of its first chunk) of program row i_nh, all int64: a
    program id is int32, and the offsets built from it (`_state_offset`) pass 2^31 from 4096 sequences × 32 heads at
    K = V = 128."""
    i_nh = i_nh.to(tl.int64)
    i_n = i_nh // H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return i_n, i_nh % H, bos, eos, tl.load(chunk_offsets + i_n).to(tl.int64)


@triton.jit
def _state_offset(i_n, i_h, H, K, V):
    """Where sequence i_n's state of head i_h starts in an (N, H, K, V) tensor."""
    return (i_n * H + i_h) * K * V


@triton.jit
def kda_fwd_kernel(q, k, v, g, beta, h0, o, ht, states, cu_seqlens, chunk_offsets, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   HAS_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_STATES: tl.constexpr):
    i_v = tl.program_id(0)
    i_n, i_h, bos, eos, first_chunk = _sequence(cu_seqlens, chunk_offsets, tl.program_id(1), H)
    rows = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    state_offs = rk[:, None] * V + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    state = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_H0:
        state = tl.load(h0 + _state_offset(i_n, i_h, H, K, V) + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    for c in range(tl.cdiv(eos - bos, BT)):
        if STORE_STATES:
            tl.store(states + ((first_chunk + c) * H + i_h) * K * V + state_offs, state, mask=state_mask)
        t = bos + c * BT + rows
        valid = t < eos
        q_c, _, _, _, gam, g_last, _, aqk, _, _, _, v_new, k_to_end = _chunk_forward(
            q, k, v, g, beta, state, t, valid, rows, rk, rv, mk, mv, scale, H, i_h, K, V, BT, BK)
        o_c = tl.dot(q_c * tl.exp(gam), state) + tl.dot(aqk, v_new)
        tl.store(o + (t[:, None] * H + i_h) * V + rv[None, :], o_c.to(o.dtype.element_ty),
                 mask=valid[:, None] & mv[None, :])
        state = state * tl.exp(g_last)[:, None] + tl.dot(tl.trans(k_to_end), v_new)
    if STORE_HT:
        tl.store(ht + _state_offset(i_n, i_h, H, K, V) + state_offs, state, mask=state_mask)


@triton.jit
def kda_bwd_kernel(q, k, v, g, beta, states, dht, do, dq, dk, dv, dg, dbeta, dh0, cu_seqlens, chunk_offsets, scale,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DHT: tl.constexpr):
    i_n, i_h, bos, eos, first_chunk = _sequence(cu_seqlens, chunk_offsets, tl.program_id(0), H)
    rows = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    state_offs = rk[:, None] * V + rv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    dstate = tl.zeros((BK, BV), dtype=tl.float32)
    if HAS_DHT:
        dstate = tl.load(dht + _state_offset(i_n, i_h, H, K, V) + state_offs, mask=state_mask, other=0.0).to(tl.float32)
    n_chunks = tl.cdiv(eos - bos, BT)
    for cc in range(n_chunks):
        c = n_chunks - 1 - cc
        state = tl.load(states + ((first_chunk + c) * H + i_h) * K * V + state_offs, mask=state_mask, other=0.0)
        t = bos + c * BT + rows
        valid = t < eos
        do_c = _load_chunk(do, t, valid, V, rv, mv, H, i_h)
        q_c, k_c, v_c, b_c, gam, g_last, akk, aqk, inv, t_mat, w, v_new, k_to_end = _chunk_forward(
            q, k, v, g, beta, state, t, valid, rows, rk, rv, mk, mv, scale, H, i_h, K, V, BT, BK)
        e_gam = tl.exp(gam)
        k_gam = k_c * e_gam
        q_gam = q_c * e_gam
        # Output and state update.
        dv_new = tl.dot(tl.trans(aqk), do_c) + tl.dot(k_to_end, dstate)
        daqk = tl.where(rows[:, None] >= rows[None, :], tl.dot(do_c, tl.trans(v_new)), 0.0)
        dq_gam = tl.dot(do_c, tl.trans(state))
        dk_to_end = tl.dot(v_new, tl.trans(dstate))
        dg_last = tl.sum(state * dstate, axis=1) * tl.exp(g_last)
        dstate = (dstate * tl.exp(g_last)[:, None] + tl.dot(tl.trans(q_gam), do_c)
                  - tl.dot(tl.trans(w), dv_new))
        # V' = T V − W S;  W = T (K ⊙ e^Γ);  T = M Diag(β);  M = (I + Diag(β) Ã)^{-1}.
        dw = -tl.dot(dv_new, tl.trans(state))
        dt_mat = tl.dot(dw, tl.trans(k_gam)) + tl.dot(dv_new, tl.trans(v_c))
        dk_gam = tl.dot(tl.trans(t_mat), dw)
        dv_c = tl.dot(tl.trans(t_mat), dv_new)
        db_c = tl.sum(dt_mat * inv, axis=0)
        da = -tl.dot(tl.trans(inv), tl.dot(dt_mat * b_c[None, :], tl.trans(inv)))
        da = tl.where(rows[:, None] > rows[None, :], da, 0.0)
        db_c += tl.sum(da * akk, axis=1)
        dakk = da * b_c[:, None]
        # Pairwise terms, column by column: d/dx_r, d/dy_j and d/dΓ of x_r y_j e^{Γ_r − Γ_j}.
        dq_c = dq_gam * e_gam
        dk_c = dk_gam * e_gam + dk_to_end * tl.exp(g_last[None, :] - gam)
        dgam = dq_gam * q_gam + dk_gam * k_gam - dk_to_end * k_to_end
        dg_last += tl.sum(dk_to_end * k_to_end, axis=0)
        for j in range(BT):
            k_j = _row(k_c, rows, j)
            g_j = _row(gam, rows, j)
            decay = tl.exp(tl.where(rows[:, None] >= j, gam - g_j[None, :], float("-inf")))
            ckk = _col(dakk, rows, j)
            cqk = _col(daqk, rows, j)
            pull_k = ckk[:, None] * k_j[None, :] * decay
            pull_q = cqk[:, None] * k_j[None, :] * decay
            dk_c += pull_k
            dq_c += pull_q
            terms = pull_k * k_c + pull_q * q_c
            dgam += terms
            on_row = rows[:, None] == j
            dk_c += tl.where(on_row, tl.sum((ckk[:, None] * k_c + cqk[:, None] * q_c) * decay, axis=0)[None, :], 0.0)
            dgam -= tl.where(on_row, tl.sum(terms, axis=0)[None, :], 0.0)
        dgam += tl.where(rows[:, None] == BT - 1, dg_last[None, :], 0.0)
        # Γ = cumsum(g) → dg is the reverse cumsum of dΓ.
        dg_c = tl.sum(dgam, axis=0)[None, :] - tl.cumsum(dgam, axis=0) + dgam
        out_k = (t[:, None] * H + i_h) * K + rk[None, :]
        mask_k = valid[:, None] & mk[None, :]
        tl.store(dq + out_k, dq_c * scale, mask=mask_k)
        tl.store(dk + out_k, dk_c, mask=mask_k)
        tl.store(dg + out_k, dg_c, mask=mask_k)
        tl.store(dv + (t[:, None] * H + i_h) * V + rv[None, :], dv_c, mask=valid[:, None] & mv[None, :])
        tl.store(dbeta + t * H + i_h, db_c, mask=valid)
    tl.store(dh0 + _state_offset(i_n, i_h, H, K, V) + state_offs, dstate, mask=state_mask)


def _launch_geometry(cu_seqlens, total_tokens: int):
    """(a bound on the packed sequences' chunk count, each sequence's first chunk), with no host sync: every
    sequence adds at most one partial chunk to total_tokens / CHUNK, so the bound comes from shapes alone."""
    lengths = cu_seqlens.diff()
    chunks = (lengths + CHUNK - 1) // CHUNK
    chunk_offsets = torch.cat([chunks.new_zeros(1), chunks.cumsum(0)])
    return total_tokens // CHUNK + lengths.numel(), chunk_offsets


def kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, keep_states):
    """Packed (1, T, H, D) inputs; returns o, the final state (or None) and the per-chunk start states (or None)."""
    _, _, n_heads, dk = q.shape
    dv = v.shape[-1]
    n_seqs = cu_seqlens.numel() - 1
    total_chunks, chunk_offsets = _launch_geometry(cu_seqlens, q.shape[1])
    bk, bv = triton.next_power_of_2(max(dk, 16)), min(64, triton.next_power_of_2(max(dv, 16)))
    o = torch.empty_like(v, dtype=q.dtype)
    ht = q.new_empty(n_seqs, n_heads, dk, dv, dtype=torch.float32) if output_final_state else None
    states = q.new_empty(total_chunks, n_heads, dk, dv, dtype=torch.float32) if keep_states else None
    grid = (triton.cdiv(dv, bv), n_seqs * n_heads)
    kda_fwd_kernel[grid](q, k, v, g, beta, initial_state, o, ht, states, cu_seqlens, chunk_offsets, scale,
                         H=n_heads, K=dk, V=dv, BT=CHUNK, BK=bk, BV=bv, HAS_H0=initial_state is not None,
                         STORE_HT=output_final_state, STORE_STATES=keep_states, num_warps=4)
    return o, ht, states


def kda_bwd(q, k, v, g, beta, scale, states, dht, do, cu_seqlens):
    """Gradients (fp32) for q, k, v, g, beta and the initial state."""
    _, _, n_heads, dk = q.shape
    dv_dim = v.shape[-1]
    n_seqs = cu_seqlens.numel() - 1
    _, chunk_offsets = _launch_geometry(cu_seqlens, q.shape[1])
    dq, dk_, dg = (torch.empty_like(q, dtype=torch.float32) for _ in range(3))
    dv = torch.empty_like(v, dtype=torch.float32)
    dbeta = torch.empty_like(beta, dtype=torch.float32)
    dh0 = q.new_empty(n_seqs, n_heads, dk, dv_dim, dtype=torch.float32)
    kda_bwd_kernel[(n_seqs * n_heads,)](
        q, k, v, g, beta, states, dht, do, dq, dk_, dv, dg, dbeta, dh0, cu_seqlens, chunk_offsets, scale,
        H=n_heads, K=dk, V=dv_dim, BT=CHUNK, BK=triton.next_power_of_2(max(dk, 16)),
        BV=triton.next_power_of_2(max(dv_dim, 16)), HAS_DHT=dht is not None, num_warps=8)
    return dq, dk_, dv, dg, dbeta, dh0


class KDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, keep_states):
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        if initial_state is not None:
            initial_state = initial_state.float().contiguous()
        o, ht, states = kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                keep_states)
        ctx.save_for_backward(q, k, v, g, beta, states, cu_seqlens)
        ctx.scale = scale
        ctx.has_initial_state = initial_state is not None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, states, cu_seqlens = ctx.saved_tensors
        dht = None if dht is None else dht.float().contiguous()
        grads = kda_bwd(q, k, v, g, beta, ctx.scale, states, dht, do.contiguous(), cu_seqlens)
        dq, dk, dv, dg, dbeta, dh0 = (grad.to(x.dtype) for grad, x in zip(grads, (q, k, v, g, beta, states)))
        return dq, dk, dv, dg, dbeta, (dh0 if ctx.has_initial_state else None), None, None, None, None


def chunk_kda_triton(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    """Same contract as `naive_recurrent_kda`; a batch is packed into one row for the kernels."""
    batch, seq_len = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    packed = cu_seqlens is not None
    if packed and batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {batch}")
    if not packed:
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, device=q.device)
        q, k, v, g, beta = (x.reshape(1, batch * seq_len, *x.shape[2:]) for x in (q, k, v, g, beta))
    # the per-chunk states are kept for the backward only when one can follow
    keep_states = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    o, ht = KDATriton.apply(q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens.to(torch.int32),
                            keep_states)
    return (o if packed else o.reshape(batch, seq_len, *o.shape[2:])), ht
