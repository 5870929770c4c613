"""Sparse attention in Triton: one program per (query, kv head, batch) owns the query group of that kv head,
walks the query's selected indices in blocks, gathers K/V rows, and keeps an online softmax (base 2). The forward
saves the LSE; the backward recomputes the probabilities from it, accumulates dQ in registers and adds dK/dV to
fp32 buffers with atomics (a key is shared by many queries).

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
def _load_q_group(ptr, q_off, stride_h, hk, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    mask = (g[:, None] < GROUP) & (d[None, :] < D)
    return tl.load(ptr + q_off + (hk * GROUP + g[:, None]) * stride_h + d[None, :], mask=mask, other=0.0)


@triton.jit
def _selection(row_ptr, start, n_sel, BLOCK_S: tl.constexpr):
    """The next BLOCK_S selected key ids of one query (int64; -1 past the end)."""
    s_off = start + tl.arange(0, BLOCK_S)
    return tl.load(row_ptr + s_off, mask=s_off < n_sel, other=-1).to(tl.int64)


@triton.jit
def _gather(base, idx, valid, stride, D: tl.constexpr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr,
            DOT_FP32: tl.constexpr):
    """Rows idx of a [S, D] matrix as [BLOCK_S, BLOCK_D] (or transposed); invalid rows and padding read 0."""
    d = tl.arange(0, BLOCK_D)
    if TRANSPOSED:
        x = tl.load(base + idx[None, :] * stride + d[:, None], mask=valid[None, :] & (d[:, None] < D), other=0.0)
    else:
        x = tl.load(base + idx[:, None] * stride + d[None, :], mask=valid[:, None] & (d[None, :] < D), other=0.0)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


def _forward_configs():
    if interpreting():  # the interpreter cannot autotune over several configs
        return [triton.Config({"BLOCK_S": 64}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_S": s}, num_warps=w, num_stages=2) for s in (32, 64) for w in (4, 8)]


@triton.autotune(configs=_forward_configs(), key=["GROUP", "DK", "DV"])
@triton.jit
def _sparse_attn_fwd(
    Q, K, V, IDX, O, LSE,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, si_b, si_t, so_b, so_t, so_h,
    n_sel, scale_log2,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    dv = tl.arange(0, BLOCK_DV)
    q = _load_q_group(Q, b * sq_b + t * sq_t, sq_h, hk, GROUP, BLOCK_G, DK, BLOCK_DK)
    if DOT_FP32:
        q = q.to(tl.float32)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    for start in range(0, n_sel, BLOCK_S):
        idx = _selection(IDX + b * si_b + t * si_t, start, n_sel, BLOCK_S)
        valid = idx >= 0
        kt = _gather(k_base, idx, valid, sk_s, DK, BLOCK_DK, True, DOT_FP32)
        vb = _gather(v_base, idx, valid, sv_s, DV, BLOCK_DV, False, DOT_FP32)
        s = tl.dot(q, kt) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: keep exp2 finite
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
        m = m_new
    has_keys = l > 0.0
    out = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, (m + tl.log2(tl.where(has_keys, l, 1.0))) / LOG2E_CONST, float("-inf"))
    o_mask = (g[:, None] < GROUP) & (dv[None, :] < DV)
    tl.store(O + b * so_b + t * so_t + (hk * GROUP + g[:, None]) * so_h + dv[None, :], out.to(O.dtype.element_ty),
             mask=o_mask)
    # LSE is [B,T,H] contiguous
    row = (b * tl.num_programs(0) + t) * (tl.num_programs(1) * GROUP) + hk * GROUP + g
    tl.store(LSE + row, lse, mask=g < GROUP)


@triton.jit
def _sparse_attn_bwd(
    Q, K, V, IDX, DO, LSE, DELTA, DQ, DK, DV,
    sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, si_b, si_t, so_b, so_t, so_h,
    sdk_b, sdk_s, sdk_h, sdv_b, sdv_s, sdv_h,
    n_sel, scale,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    HEAD_DK: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = _load_q_group(Q, b * sq_b + t * sq_t, sq_h, hk, GROUP, BLOCK_G, HEAD_DK, BLOCK_DK)
    do = _load_q_group(DO, b * so_b + t * so_t, so_h, hk, GROUP, BLOCK_G, HEAD_DV, BLOCK_DV)
    if DOT_FP32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = (b * tl.num_programs(0) + t) * (tl.num_programs(1) * GROUP) + hk * GROUP + g
    lse = tl.load(LSE + row, mask=g < GROUP, other=float("-inf")) * LOG2E_CONST
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows without keys: every p becomes 0
    delta = tl.load(DELTA + row, mask=g < GROUP, other=0.0)
    dq = tl.zeros([BLOCK_G, BLOCK_DK], tl.float32)
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    dk_base = DK + b * sdk_b + hk * sdk_h
    dv_base = DV + b * sdv_b + hk * sdv_h
    for start in range(0, n_sel, BLOCK_S):
        idx = _selection(IDX + b * si_b + t * si_t, start, n_sel, BLOCK_S)
        valid = idx >= 0
        kt = _gather(k_base, idx, valid, sk_s, HEAD_DK, BLOCK_DK, True, DOT_FP32)
        vt = _gather(v_base, idx, valid, sv_s, HEAD_DV, BLOCK_DV, True, DOT_FP32)
        s = tl.dot(q, kt) * (scale * LOG2E_CONST)
        p = tl.where(valid[None, :], tl.exp2(s - lse[:, None]), 0.0)
        ds = p * (tl.dot(do, vt) - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt))
        dk_blk = tl.dot(tl.trans(ds.to(q.dtype)), q) * scale
        dv_blk = tl.dot(tl.trans(p.to(do.dtype)), do)
        tl.atomic_add(dk_base + idx[:, None] * sdk_s + dk[None, :], dk_blk,
                      mask=valid[:, None] & (dk[None, :] < HEAD_DK))
        tl.atomic_add(dv_base + idx[:, None] * sdv_s + dv[None, :], dv_blk,
                      mask=valid[:, None] & (dv[None, :] < HEAD_DV))
    tl.store(DQ + b * sq_b + t * sq_t + (hk * GROUP + g[:, None]) * sq_h + dk[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(g[:, None] < GROUP) & (dk[None, :] < HEAD_DK))


def _meta(q, k, v, indices) -> dict:
    group = q.shape[2] // k.shape[2]
    return {
        "GROUP": group, "BLOCK_G": max(16, triton.next_power_of_2(group)),
        "BLOCK_DK": max(16, triton.next_power_of_2(k.shape[3])),
        "BLOCK_DV": max(16, triton.next_power_of_2(v.shape[3])),
        # the interpreter multiplies bf16 bit patterns in tl.dot: compute in fp32 there
        "DOT_FP32": interpreting() and q.dtype == torch.bfloat16,
    }


def _strides(q, k, v, indices, o):
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), indices.stride(0), indices.stride(1),
            o.stride(0), o.stride(1), o.stride(2))


def _check(*tensors):
    for x in tensors:
        if x.stride(-1) != 1:
            raise ValueError("sparse attention needs the feature dim contiguous")


def forward(q, k, v, indices, scale):
    """Output [B,T,H,Dv] (q's dtype) and LSE [B,T,H] (fp32, natural log; -inf for a query without keys)."""
    indices = indices.to(torch.int32).contiguous()
    _check(q, k, v)
    batch, q_len, heads, _ = q.shape
    out = q.new_empty(batch, q_len, heads, v.shape[3])
    lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=q.device)
    _sparse_attn_fwd[(q_len, k.shape[2], batch)](
        q, k, v, indices, out, lse, *_strides(q, k, v, indices, out), indices.shape[2], scale * LOG2E,
        DK=k.shape[3], DV=v.shape[3], **_meta(q, k, v, indices))
    return out, lse


def backward(q, k, v, indices, scale, out, lse, grad_out):
    indices = indices.to(torch.int32).contiguous()
    grad_out = grad_out.contiguous()
    _check(q, k, v)
    delta = (out.float() * grad_out.float()).sum(-1).contiguous()
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    _sparse_attn_bwd[(q.shape[1], k.shape[2], q.shape[0])](
        q, k, v, indices, grad_out, lse, delta, dq, dk, dv, *_strides(q, k, v, indices, grad_out),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        indices.shape[2], scale, HEAD_DK=k.shape[3], HEAD_DV=v.shape[3], BLOCK_S=64, num_warps=4, num_stages=1,
        **_meta(q, k, v, indices))
    return dq, dk.to(k.dtype), dv.to(v.dtype)
