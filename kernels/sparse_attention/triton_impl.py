"""Sparse attention in Triton, shaped for MLA's shared latent (one kv head, up to 128 query heads, head dims
512 + 64) as well as for grouped heads.

Forward and dQ: one program per (query, block of query heads of one kv head, batch) walks the query's selected
indices in blocks, gathers each key row once for all heads of the block, and keeps an online softmax (base 2).
dK/dV in one of two orders (dkv_order chooses from the shapes). Key-major, no atomics: the selection is inverted
first (invert_selection: for each block of BLOCK_N keys, the queries that selected any of them, with a bitmask of
which); one program per key block then walks those queries, like FlashAttention's backward over a sparse set of
query rows, and stores its rows once (deterministic). Its cost grows with the (query, key block) pairs: each reads
the query's q and dO for all heads and computes the whole block, so scattered selections pay up to a block per
selected key, and a block every query selects is one program's serial work. Query-major, fp32 atomics: one
program per query walks its own selection in blocks, as the forward does, and adds each block's dK/dV rows
atomically: its cost is the selection's size whatever its pattern.

The key head dim is split into a power-of-two main part and a tail (576 = 512 + 64, 192 = 128 + 64), so no tile is
padded to the next power of two. When the values are the first columns of the keys (MLA's latent: v = kv[..., :r])
the kernels read them from the key tiles (DVT of them from the tail: a LoRA adapter's per-token latent rides
there, families/mla.py) and dK/dV come back as one gradient of the keys.

Layouts: q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv] (last dim contiguous), indices [B,T,K] int32, -1 = no key.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LOG2E_CONST = tl.constexpr(LOG2E)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rows(base, rows, row_ok, stride, col0, D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """[rows, BLOCK_D]: columns col0 .. col0 + D of the given rows of a row-major matrix; masked rows and the
    padding columns read 0."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(base + rows[:, None] * stride + col0 + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _selection(row_ptr, start, n_sel, BLOCK_S: tl.constexpr):
    """The next BLOCK_S selected key ids of one query (int64; -1 past the end)."""
    s_off = start + tl.arange(0, BLOCK_S)
    return tl.load(row_ptr + s_off, mask=s_off < n_sel, other=-1).to(tl.int64)


@triton.jit
def _head_block(pid, GROUP: tl.constexpr, BLOCK_H: tl.constexpr):
    """(kv head, query head ids [BLOCK_H], which of them exist) of the program `pid` along the head axis."""
    n_hb: tl.constexpr = (GROUP + BLOCK_H - 1) // BLOCK_H
    hk = pid // n_hb
    g = (pid % n_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    return hk, hk * GROUP + g, g < GROUP


@triton.jit
def _key_rows(k_base, v_base, rows, ok, sk_s, sv_s, DKM: tl.constexpr, DKT: tl.constexpr, BLOCK_DKT: tl.constexpr,
              DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr, DOT_FP32: tl.constexpr):
    """The key rows `rows` (main part, tail) and their values; without a tail or with shared values the unused
    tiles are the main part's."""
    k_main = _rows(k_base, rows, ok, sk_s, 0, DKM, DKM, DOT_FP32)
    k_tail = k_main
    if DKT > 0:
        k_tail = _rows(k_base, rows, ok, sk_s, DKM, DKT, BLOCK_DKT, DOT_FP32)
    vb = k_main
    if not SHARED_V:
        vb = _rows(v_base, rows, ok, sv_s, 0, DV, BLOCK_DV, DOT_FP32)
    return k_main, k_tail, vb


@triton.jit
def _gathered(q_main, q_tail, k_base, v_base, idx, valid, sk_s, sv_s, DKM: tl.constexpr, DKT: tl.constexpr,
              BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
              DOT_FP32: tl.constexpr):
    """The key rows idx (main part, tail) and their values, gathered once for all heads of the block, and the
    heads' raw scores against them [BLOCK_H, BLOCK_S]."""
    k_main, k_tail, vb = _key_rows(k_base, v_base, idx, valid, sk_s, sv_s, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV,
                                   SHARED_V, DOT_FP32)
    s = tl.dot(q_main, tl.trans(k_main))
    if DKT > 0:
        s += tl.dot(q_tail, tl.trans(k_tail))
    return s, k_main, k_tail, vb


def _forward_configs():
    if interpreting():  # the interpreter cannot autotune over several configs
        return [triton.Config({"BLOCK_S": 32}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_S": s}, num_warps=8, num_stages=2) for s in (32, 64)]


@triton.autotune(configs=_forward_configs(), key=["GROUP", "BLOCK_H", "DKM", "DKT", "DV", "SHARED_V", "DVT"])
@triton.jit
def _sparse_attn_fwd(
    Q, K, V, IDX, O, LSE,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, si_b, si_t, so_b, so_t, so_h,
    q_len, n_heads, n_sel, scale_log2,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr,
    BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
    DVT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hk, heads, head_ok = _head_block(tl.program_id(1).to(tl.int64), GROUP, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    q_base = Q + b * sq_b + t * sq_t
    q_main = _rows(q_base, heads, head_ok, sq_h, 0, DKM, DKM, DOT_FP32)
    q_tail = q_main  # unused without a tail
    if DKT > 0:
        q_tail = _rows(q_base, heads, head_ok, sq_h, DKM, DKT, BLOCK_DKT, DOT_FP32)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    if DVT > 0:
        acc_tail = tl.zeros([BLOCK_H, BLOCK_DKT], tl.float32)  # value columns DKM .. DKM + DVT
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for start in range(0, n_sel, BLOCK_S):
        idx = _selection(IDX + b * si_b + t * si_t, start, n_sel, BLOCK_S)
        valid = idx >= 0
        s, k_main, k_tail, vb = _gathered(q_main, q_tail, k_base, v_base, idx, valid, sk_s, sv_s, DKM, DKT, BLOCK_DKT,
                                          DV, BLOCK_DV, SHARED_V, DOT_FP32)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp2 finite
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        if DVT > 0:
            acc_tail = acc_tail * alpha[:, None] + tl.dot(p.to(k_tail.dtype), k_tail)
        m = m_new
    has_keys = l > 0.0
    norm = tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) / LOG2E_CONST, float("-inf"))
    o_base = O + b * so_b + t * so_t + heads[:, None] * so_h
    dv = tl.arange(0, BLOCK_DV)
    tl.store(o_base + dv[None, :], (acc / norm).to(O.dtype.element_ty),
             mask=head_ok[:, None] & (dv[None, :] < DV))
    if DVT > 0:
        d_tail = tl.arange(0, BLOCK_DKT)
        tl.store(o_base + DKM + d_tail[None, :], (acc_tail / norm).to(O.dtype.element_ty),
                 mask=head_ok[:, None] & (d_tail[None, :] < DVT))
    tl.store(LSE + (b * q_len + t) * n_heads + heads, lse, mask=head_ok)  # LSE is [B,T,H] contiguous


@triton.jit
def _sparse_attn_bwd_dq(
    Q, K, V, IDX, DO, LSE, DELTA, DQ,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, si_b, si_t, so_b, so_t, so_h,
    q_len, n_heads, n_sel, scale_log2, scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr,
    BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
    DVT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hk, heads, head_ok = _head_block(tl.program_id(1).to(tl.int64), GROUP, BLOCK_H)
    b = tl.program_id(2).to(tl.int64)
    q_base = Q + b * sq_b + t * sq_t
    q_main = _rows(q_base, heads, head_ok, sq_h, 0, DKM, DKM, DOT_FP32)
    q_tail = q_main  # unused without a tail
    if DKT > 0:
        q_tail = _rows(q_base, heads, head_ok, sq_h, DKM, DKT, BLOCK_DKT, DOT_FP32)
        dq_tail = tl.zeros([BLOCK_H, BLOCK_DKT], tl.float32)
    do_base = DO + b * so_b + t * so_t
    do = _rows(do_base, heads, head_ok, so_h, 0, DV, BLOCK_DV, DOT_FP32)
    if DVT > 0:
        do_tail = _rows(do_base, heads, head_ok, so_h, DKM, DVT, BLOCK_DKT, DOT_FP32)
    row = (b * q_len + t) * n_heads + heads
    lse = tl.load(LSE + row, mask=head_ok, other=float("-inf")) * LOG2E_CONST
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows without keys: every p becomes 0
    delta = tl.load(DELTA + row, mask=head_ok, other=0.0)
    dq_main = tl.zeros([BLOCK_H, DKM], tl.float32)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for start in range(0, n_sel, BLOCK_S):
        idx = _selection(IDX + b * si_b + t * si_t, start, n_sel, BLOCK_S)
        valid = idx >= 0
        s, k_main, k_tail, vb = _gathered(q_main, q_tail, k_base, v_base, idx, valid, sk_s, sv_s, DKM, DKT, BLOCK_DKT,
                                          DV, BLOCK_DV, SHARED_V, DOT_FP32)
        p = tl.where(valid[None, :], tl.exp2(s * scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(vb))
        if DVT > 0:
            dp += tl.dot(do_tail, tl.trans(k_tail))
        ds = (p * (dp - delta[:, None])).to(k_main.dtype)
        dq_main += tl.dot(ds, k_main)
        if DKT > 0:
            dq_tail += tl.dot(ds, k_tail)
    dq_base = DQ + b * sq_b + t * sq_t
    d = tl.arange(0, DKM)
    tl.store(dq_base + heads[:, None] * sq_h + d[None, :], (dq_main * scale).to(DQ.dtype.element_ty),
             mask=head_ok[:, None])
    if DKT > 0:
        d_tail = tl.arange(0, BLOCK_DKT)
        tl.store(dq_base + heads[:, None] * sq_h + DKM + d_tail[None, :], (dq_tail * scale).to(DQ.dtype.element_ty),
                 mask=head_ok[:, None] & (d_tail[None, :] < DKT))


@triton.jit
def _dkv_of_query(dk_main, dk_tail, dv_acc, k_main, k_tail, vb, chosen, Q, DO, LSE, DELTA, b, t, hk,
                  sq_b, sq_t, sq_h, so_b, so_t, so_h, q_len, n_heads, scale_log2, scale,
                  GROUP: tl.constexpr, BLOCK_H: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr,
                  BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
                  DVT: tl.constexpr, DOT_FP32: tl.constexpr):
    """The accumulators (dK main and tail, dV; [rows, ...] fp32) plus what query t's heads of kv head hk give the
    key rows (k_main, k_tail, vb), of which it selected those `chosen`. With SHARED_V the value gradient goes to
    the key columns the values are (main, and DVT of the tail) and dv_acc is passed through."""
    q_base = Q + b * sq_b + t * sq_t
    do_base = DO + b * so_b + t * so_t
    for h0 in range(0, GROUP, BLOCK_H):
        g = h0 + tl.arange(0, BLOCK_H)
        head_ok = g < GROUP
        heads = hk * GROUP + g
        q_main = _rows(q_base, heads, head_ok, sq_h, 0, DKM, DKM, DOT_FP32)
        s = tl.dot(k_main, tl.trans(q_main))  # [rows, BLOCK_H]
        if DKT > 0:
            q_tail = _rows(q_base, heads, head_ok, sq_h, DKM, DKT, BLOCK_DKT, DOT_FP32)
            s += tl.dot(k_tail, tl.trans(q_tail))
        do = _rows(do_base, heads, head_ok, so_h, 0, DV, BLOCK_DV, DOT_FP32)
        row = (b * q_len + t) * n_heads + heads
        lse = tl.load(LSE + row, mask=head_ok, other=0.0) * LOG2E_CONST  # -inf only where nothing is chosen
        delta = tl.load(DELTA + row, mask=head_ok, other=0.0)
        p = tl.where(chosen[:, None] & head_ok[None, :], tl.exp2(s * scale_log2 - lse[None, :]), 0.0)
        dp = tl.dot(vb, tl.trans(do))
        if DVT > 0:
            do_tail = _rows(do_base, heads, head_ok, so_h, DKM, DVT, BLOCK_DKT, DOT_FP32)
            dp += tl.dot(k_tail, tl.trans(do_tail))
            dk_tail += tl.dot(p.to(do_tail.dtype), do_tail)
        ds = (p * (dp - delta[None, :]) * scale).to(q_main.dtype)
        dk_main += tl.dot(ds, q_main)
        if DKT > 0:
            dk_tail += tl.dot(ds, q_tail)
        if SHARED_V:
            dk_main += tl.dot(p.to(do.dtype), do)
        else:
            dv_acc += tl.dot(p.to(do.dtype), do)
    return dk_main, dk_tail, dv_acc


@triton.jit
def _dkv_zeros(ROWS: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr, BLOCK_DKT: tl.constexpr,
               BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr):
    """Zero accumulators (dK main, dK tail, dV) for ROWS key rows; the unused ones are the main part's."""
    dk_main = tl.zeros([ROWS, DKM], tl.float32)
    dk_tail = dk_main
    if DKT > 0:
        dk_tail = tl.zeros([ROWS, BLOCK_DKT], tl.float32)
    dv_acc = dk_main
    if not SHARED_V:
        dv_acc = tl.zeros([ROWS, BLOCK_DV], tl.float32)
    return dk_main, dk_tail, dv_acc


@triton.jit
def _put(ptrs, value, mask, ATOMIC: tl.constexpr):
    if ATOMIC:
        tl.atomic_add(ptrs, value, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _put_dkv(dk_base, dv_base, rows, ok, sdk_s, sdv_s, dk_main, dk_tail, dv_acc, ATOMIC: tl.constexpr,
             DKM: tl.constexpr, DKT: tl.constexpr, BLOCK_DKT: tl.constexpr, DV: tl.constexpr,
             BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr):
    """Stores (key-major: each row once) or adds (ATOMIC, query-major: fp32, relaxed) the accumulators to `rows`."""
    d = tl.arange(0, DKM)
    _put(dk_base + rows[:, None] * sdk_s + d[None, :], dk_main, ok[:, None], ATOMIC)
    if DKT > 0:
        d_tail = tl.arange(0, BLOCK_DKT)
        _put(dk_base + rows[:, None] * sdk_s + DKM + d_tail[None, :], dk_tail, ok[:, None] & (d_tail[None, :] < DKT),
             ATOMIC)
    if not SHARED_V:
        dv = tl.arange(0, BLOCK_DV)
        _put(dv_base + rows[:, None] * sdv_s + dv[None, :], dv_acc, ok[:, None] & (dv[None, :] < DV), ATOMIC)


@triton.jit
def _sparse_attn_bwd_dkv(
    Q, K, V, DO, LSE, DELTA, OFFSETS, PAIR_Q, PAIR_BITS, DK_OUT, DV_OUT,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_t, so_h,
    sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h,
    q_len, kv_len, n_heads, n_blocks, scale_log2, scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr,
    BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
    DVT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Key-major: one program per (block of BLOCK_N keys, kv head, batch): dK/dV of those rows from the queries that
    selected any of them (PAIR_Q/PAIR_BITS[OFFSETS[b, blk] : OFFSETS[b, blk + 1]]), stored once."""
    blk = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < kv_len
    k_main, k_tail, vb = _key_rows(K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, n, n_ok, sk_s, sv_s, DKM,
                                   DKT, BLOCK_DKT, DV, BLOCK_DV, SHARED_V, DOT_FP32)
    dk_main, dk_tail, dv_acc = _dkv_zeros(BLOCK_N, DKM, DKT, BLOCK_DKT, BLOCK_DV, SHARED_V)
    bit = tl.arange(0, BLOCK_N).to(tl.int64)
    lo = tl.load(OFFSETS + b * n_blocks + blk)
    hi = tl.load(OFFSETS + b * n_blocks + blk + 1)
    for pair in range(lo, hi):
        t = tl.load(PAIR_Q + pair).to(tl.int64)
        chosen = ((tl.load(PAIR_BITS + pair) >> bit) & 1) != 0  # which of the block's keys query t selected
        dk_main, dk_tail, dv_acc = _dkv_of_query(
            dk_main, dk_tail, dv_acc, k_main, k_tail, vb, chosen, Q, DO, LSE, DELTA, b, t, hk, sq_b, sq_t, sq_h,
            so_b, so_t, so_h, q_len, n_heads, scale_log2, scale, GROUP, BLOCK_H, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV,
            SHARED_V, DVT, DOT_FP32)
    _put_dkv(DK_OUT + b * sdk_b + hk * sdk_h, DV_OUT + b * sdv_b + hk * sdv_h, n, n_ok, sdk_s, sdv_s, dk_main,
             dk_tail, dv_acc, False, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV, SHARED_V)


@triton.jit
def _sparse_attn_bwd_dkv_query_major(
    Q, K, V, IDX, DO, LSE, DELTA, DK_OUT, DV_OUT,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, si_b, si_t, so_b, so_t, so_h,
    sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h,
    q_len, n_heads, n_sel, scale_log2, scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, DKM: tl.constexpr, DKT: tl.constexpr,
    BLOCK_DKT: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_V: tl.constexpr,
    DVT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Query-major: one program per (query, kv head, batch): for each BLOCK_S of the query's selected keys, what all
    its heads of that kv head give their dK/dV, added atomically (fp32) to those rows (DK_OUT/DV_OUT start zeroed).
    Each query's q and dO are read once per block of its own selection, and only selected rows are computed."""
    t = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for start in range(0, n_sel, BLOCK_S):
        idx = _selection(IDX + b * si_b + t * si_t, start, n_sel, BLOCK_S)
        valid = idx >= 0
        k_main, k_tail, vb = _key_rows(k_base, v_base, idx, valid, sk_s, sv_s, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV,
                                       SHARED_V, DOT_FP32)
        dk_main, dk_tail, dv_acc = _dkv_zeros(BLOCK_S, DKM, DKT, BLOCK_DKT, BLOCK_DV, SHARED_V)
        dk_main, dk_tail, dv_acc = _dkv_of_query(
            dk_main, dk_tail, dv_acc, k_main, k_tail, vb, valid, Q, DO, LSE, DELTA, b, t, hk, sq_b, sq_t, sq_h,
            so_b, so_t, so_h, q_len, n_heads, scale_log2, scale, GROUP, BLOCK_H, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV,
            SHARED_V, DVT, DOT_FP32)
        _put_dkv(DK_OUT + b * sdk_b + hk * sdk_h, DV_OUT + b * sdv_b + hk * sdv_h, idx, valid, sdk_s, sdv_s,
                 dk_main, dk_tail, dv_acc, True, DKM, DKT, BLOCK_DKT, DV, BLOCK_DV, SHARED_V)


def invert_selection(indices: torch.Tensor, kv_len: int, block_n: int):
    """Key-major view of a selection, computed on its device without a host sync: (offsets [B * blocks + 1],
    pair_q [P] int32, pair_bits [P] int64). The pairs offsets[b * blocks + j] : offsets[b * blocks + j + 1] are the
    queries (ascending) of batch row b that selected keys of block j (keys j * block_n ..), and bit i of a pair's
    bits says whether key j * block_n + i is one of them. P is bounded by the B * T * K slots (unused ones sit past
    the last offset)."""
    batch, q_len, _ = indices.shape
    n_blocks = -(-kv_len // block_n)
    idx = indices.long()
    row = torch.arange(batch, device=idx.device).view(-1, 1, 1) * n_blocks + idx.clamp(min=0) // block_n
    code = row * q_len + torch.arange(q_len, device=idx.device).view(1, -1, 1)  # sorts by (batch, block, query)
    unused = batch * n_blocks * q_len
    # one sort of (pair code, key bit) keys: no permutation to gather with afterwards
    slots = torch.where(idx >= 0, code * block_n + idx % block_n, unused * block_n).flatten().msort()
    del idx, row, code
    code, bits = slots // block_n, torch.ones_like(slots) << (slots % block_n)
    del slots
    pair = torch.ones_like(code, dtype=torch.bool)
    pair[1:] = code[1:] != code[:-1]
    pair = pair.cumsum(0) - 1  # the pair each slot belongs to (slots of one (block, query) are adjacent)
    pair_code = torch.full_like(code, unused).scatter_(0, pair, code)  # every slot of a pair writes the same code
    pair_bits = torch.zeros_like(bits).scatter_add_(0, pair, bits)  # a query's keys are distinct: sum = or
    bounds = torch.arange(batch * n_blocks + 1, device=code.device) * q_len
    offsets = torch.searchsorted(pair_code, bounds)
    return offsets, (pair_code % q_len).to(torch.int32), pair_bits


def _split(dim: int) -> tuple[int, int, int]:
    """A head dim (>= 16) as (power-of-two main part, tail, the tail's block): 576 -> (512, 64, 64)."""
    main = 1 << (dim.bit_length() - 1)
    tail = dim - main
    return main, tail, max(16, triton.next_power_of_2(tail)) if tail else 16


def _shared_v(k, v) -> bool:
    """v is k[..., :Dv] and covers at least the key's main part (MLA's latent as keys and values)."""
    return (v.data_ptr() == k.data_ptr() and v.stride() == k.stride() and v.shape[:3] == k.shape[:3]
            and v.shape[3] >= _split(k.shape[3])[0])


def _meta(q, k, v) -> dict:
    group = q.shape[2] // k.shape[2]
    dkm, dkt, block_dkt = _split(k.shape[3])
    shared = _shared_v(k, v)
    block_dv = dkm if shared else max(16, triton.next_power_of_2(v.shape[3]))
    return {
        # heads per program: every gathered row serves all of them; fewer when the fp32 accumulators grow
        "GROUP": group, "BLOCK_H": min(max(16, triton.next_power_of_2(group)), 64 if block_dv <= 256 else 32),
        # DV: the value columns of V, or of the key's main part when shared (DVT more come from its tail)
        "DKM": dkm, "DKT": dkt, "BLOCK_DKT": block_dkt, "DV": dkm if shared else v.shape[3], "BLOCK_DV": block_dv,
        "SHARED_V": shared, "DVT": v.shape[3] - dkm if shared else 0,
        # the interpreter multiplies bf16 bit patterns in tl.dot: compute in fp32 there
        "DOT_FP32": interpreting() and q.dtype == torch.bfloat16,
    }


def _grid_heads(k, meta) -> int:
    return k.shape[2] * triton.cdiv(meta["GROUP"], meta["BLOCK_H"])


def _strides(*tensors):
    return tuple(s for x in tensors for s in x.stride()[:-1])


def _check(q, k, v):
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise ValueError("sparse attention needs the feature dim contiguous")
    if k.shape[3] < 16:  # tl.dot's least inner dimension on a GPU; every model's heads are wider
        raise ValueError(f"the Triton sparse attention needs key heads of at least 16 dims (got {k.shape[3]}); "
                         "backend='torch' takes any")


def forward(q, k, v, indices, scale):
    """Output [B,T,H,Dv] (q's dtype) and LSE [B,T,H] (fp32, natural log; -inf for a query without keys)."""
    indices = indices.to(torch.int32).contiguous()
    _check(q, k, v)
    batch, q_len, heads, _ = q.shape
    out = q.new_empty(batch, q_len, heads, v.shape[3])
    lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=q.device)
    meta = _meta(q, k, v)
    _sparse_attn_fwd[(q_len, _grid_heads(k, meta), batch)](
        q, k, v, indices, out, lse, *_strides(q, k, v, indices, out), q_len, heads, indices.shape[2], scale * LOG2E,
        **meta)
    return out, lse


DKV_ORDERS = ("key_major", "query_major")
KEY_MAJOR_MIN_DENSITY = 0.5  # bench/gpu_check.py's sparse_dkv stage times both orders on a device


def dkv_order(kv_len: int, n_sel: int) -> str:
    """The dK/dV pass for a top-n_sel selection over kv_len keys, from the shapes alone (no host sync): key-major
    where the selection covers at least KEY_MAJOR_MIN_DENSITY of the keys (the key blocks a query touches are then
    mostly chosen, whatever it selects), else query-major."""
    return "key_major" if n_sel >= KEY_MAJOR_MIN_DENSITY * kv_len else "query_major"


def _dkv_key_major(q, k, v, indices, grad_out, lse, delta, dk, dv, block_n, scale, meta):
    offsets, pair_q, pair_bits = invert_selection(indices, k.shape[1], block_n)
    n_blocks = triton.cdiv(k.shape[1], block_n)
    _sparse_attn_bwd_dkv[(n_blocks, k.shape[2], q.shape[0])](
        q, k, v, grad_out, lse, delta, offsets, pair_q, pair_bits, dk, dv, *_strides(q, k, v, grad_out, dk, dv),
        q.shape[1], k.shape[1], q.shape[2], n_blocks, scale * LOG2E, scale, BLOCK_N=block_n, num_warps=8,
        num_stages=1, **meta)


def _dkv_query_major(q, k, v, indices, grad_out, lse, delta, dk, dv, block_s, scale, meta):
    # num_stages=2: the pipelined lowering keeps every case of kernels.compile_check in registers on sm_90 (with
    # one stage, a LoRA adapter's latent in the tail spilled 256 B per thread, the plain latent 8-16 B)
    _sparse_attn_bwd_dkv_query_major[(q.shape[1], k.shape[2], q.shape[0])](
        q, k, v, indices, grad_out, lse, delta, dk, dv, *_strides(q, k, v, indices, grad_out, dk, dv), q.shape[1],
        q.shape[2], indices.shape[2], scale * LOG2E, scale, BLOCK_S=block_s, num_warps=8, num_stages=2, **meta)


def backward(q, k, v, indices, scale, out, lse, grad_out, order: str | None = None):
    """(dq, dk, dv) in the input dtypes; with values shared from the keys, dk carries both and dv is None.
    `order`: the dK/dV pass, one of DKV_ORDERS (default: dkv_order's choice)."""
    order = order or dkv_order(k.shape[1], indices.shape[2])
    if order not in DKV_ORDERS:
        raise ValueError(f"unknown dK/dV order {order!r} (expected one of {DKV_ORDERS})")
    indices = indices.to(torch.int32).contiguous()
    grad_out = grad_out.contiguous()
    _check(q, k, v)
    batch, q_len, heads, _ = q.shape
    meta = _meta(q, k, v)
    if meta["DKM"] > 256 and meta["BLOCK_DKT"] > 64:  # a latent with a wide tail: fewer heads per program
        meta["BLOCK_H"] = min(meta["BLOCK_H"], 16)
    delta = (out.float() * grad_out.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    _sparse_attn_bwd_dq[(q_len, _grid_heads(k, meta), batch)](
        q, k, v, indices, grad_out, lse, delta, dq, *_strides(q, k, v, indices, grad_out), q_len, heads,
        indices.shape[2], scale * LOG2E, scale, BLOCK_S=32, num_warps=8, num_stages=1, **meta)
    # 16 keys per program at latent widths: its [keys, 512] fp32 accumulators stay in registers (sm_90 build)
    rows = 16 if max(meta["BLOCK_DV"], meta["DKM"]) > 256 else 64
    # key-major stores every row; query-major adds into zeros
    new = torch.empty if order == "key_major" else torch.zeros
    dk = new(k.shape, dtype=torch.float32, device=k.device)
    dv = dk if meta["SHARED_V"] else new(v.shape, dtype=torch.float32, device=v.device)
    if order == "key_major":
        _dkv_key_major(q, k, v, indices, grad_out, lse, delta, dk, dv, rows, scale, meta)
    else:  # no wider than the selection
        rows = max(16, min(rows, triton.next_power_of_2(indices.shape[2])))
        _dkv_query_major(q, k, v, indices, grad_out, lse, delta, dk, dv, rows, scale, meta)
    return dq, dk.to(k.dtype), None if meta["SHARED_V"] else dv.to(v.dtype)
