"""Grouped GEMM over experts with the LoRA update fused in, in Triton.

Rows arrive sorted by expert. A small tile map (built on the device, no host sync) names, for each BLOCK_M tile of
rows, its expert and first row; tiles past the real count exit at once, and experts with no tokens own no tile.
  _grouped_lora_mm:  Y[rows] = X[rows] W_e (+ s (X[rows] A_e) B_e), the rank-r product accumulated in the same K loop
  _grouped_outer:    OUT_e = s * L[rows of e]^T R[rows of e]  (the per-expert reductions behind dA and dB)
The backward reuses _grouped_lora_mm on transposed views: dX = dY W^T + s (dY B^T) A^T.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M = 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _grouped_lora_mm(
    X, W, A, B, Y, TILE_EXPERT, TILE_ROW, OFFS,
    d_in, d_out, rank, scale,
    sx_n, sx_k, sw_e, sw_k, sw_n, sa_e, sa_k, sa_r, sb_e, sb_r, sb_n, sy_n, sy_m,
    HAS_LORA: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    e = tl.load(TILE_EXPERT + tile).to(tl.int64)
    if e < 0:
        return
    rows = tl.load(TILE_ROW + tile).to(tl.int64) + tl.arange(0, BLOCK_M)
    row_mask = rows < tl.load(OFFS + e)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < d_out
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    xa = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for k0 in range(0, d_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < d_in
        x = tl.load(X + rows[:, None] * sx_n + kk[None, :] * sx_k, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(W + e * sw_e + kk[:, None] * sw_k + cols[None, :] * sw_n, mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w)
        if HAS_LORA:
            a = tl.load(A + e * sa_e + kk[:, None] * sa_k + r[None, :] * sa_r, mask=k_mask[:, None] & (r[None, :] < rank),
                        other=0.0)
            xa += tl.dot(x, a.to(x.dtype))
    if HAS_LORA:
        b = tl.load(B + e * sb_e + r[:, None] * sb_r + cols[None, :] * sb_n, mask=(r[:, None] < rank) & col_mask[None, :],
                    other=0.0)
        if DOT_FP32:
            b = b.to(tl.float32)
        acc += scale * tl.dot(xa.to(b.dtype), b)  # the rank-r product rounds like the unfused (xA)B would
    tl.store(Y + rows[:, None] * sy_n + cols[None, :] * sy_m, acc.to(Y.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_outer(
    L, R, OUT, OFFS, p_dim, q_dim, scale,
    sl_n, sl_p, sr_n, sr_q, so_e, so_p, so_q,
    DOT_FP32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    end = tl.load(OFFS + e).to(tl.int64)
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_mask = t < end
        lt = tl.load(L + t[None, :] * sl_n + p[:, None] * sl_p, mask=t_mask[None, :] & (p[:, None] < p_dim), other=0.0)
        rt = tl.load(R + t[:, None] * sr_n + q[None, :] * sr_q, mask=t_mask[:, None] & (q[None, :] < q_dim), other=0.0)
        if DOT_FP32:
            lt = lt.to(tl.float32)
            rt = rt.to(tl.float32)
        acc += tl.dot(lt, rt)
    tl.store(OUT + e * so_e + p[:, None] * so_p + q[None, :] * so_q, (acc * scale).to(OUT.dtype.element_ty),
             mask=(p[:, None] < p_dim) & (q[None, :] < q_dim))


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(n)))


def _rank_block(rank: int) -> int:
    """The whole LoRA rank sits in one tile (xA is accumulated across the K loop), so it is never capped."""
    return max(16, triton.next_power_of_2(rank))


def tile_map(counts: torch.Tensor, n_rows: int):
    """(expert per tile or -1, first row per tile, end offset per expert) for BLOCK_M row tiles, built on-device."""
    counts = counts.to(torch.int64)
    offs = counts.cumsum(0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tiles.cumsum(0)
    n_tiles = triton.cdiv(n_rows, BLOCK_M) + counts.numel()  # upper bound: one partial tile per expert
    tile = torch.arange(n_tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, tile, right=True)
    e = expert.clamp(max=counts.numel() - 1)
    first_row = (offs - counts)[e] + (tile - (tile_end - tiles)[e]) * BLOCK_M
    return torch.where(expert < counts.numel(), expert, -1).to(torch.int32), first_row, offs


def grouped_lora_mm(x, w, a, b, scale: float, tiles, out_dtype=None):
    """x [N, K] sorted by expert, w [E, K, M] (any strides), a [E, K, r] / b [E, r, M] or None -> [N, M]."""
    expert, first_row, offs = tiles
    d_out = w.shape[2]
    y = torch.empty(x.shape[0], d_out, dtype=out_dtype or x.dtype, device=x.device)
    has_lora = a is not None
    a_, b_ = (a, b) if has_lora else (w, w)  # unused pointers when there is no LoRA
    rank = a.shape[2] if has_lora else 0
    block_n = _block(d_out, 128)
    grid = (expert.numel(), triton.cdiv(d_out, block_n))
    _grouped_lora_mm[grid](
        x, w, a_, b_, y, expert, first_row, offs, w.shape[1], d_out, rank, scale,
        x.stride(0), x.stride(1), *w.stride(), *a_.stride(), *b_.stride(), y.stride(0), y.stride(1),
        HAS_LORA=has_lora, DOT_FP32=interpreting() and x.dtype == torch.bfloat16, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=_block(w.shape[1], 64), BLOCK_R=_rank_block(rank), num_warps=4, num_stages=3)
    return y


def grouped_outer(left, right, offs, scale: float, out_dtype):
    """OUT[e] = scale * left[rows of e]^T right[rows of e]: [E, P, Q]; experts without rows get zeros."""
    p_dim, q_dim = left.shape[1], right.shape[1]
    out = torch.empty(offs.numel(), p_dim, q_dim, dtype=out_dtype, device=left.device)
    block_p, block_q = _block(p_dim, 64), _block(q_dim, 64)
    grid = (offs.numel(), triton.cdiv(p_dim, block_p), triton.cdiv(q_dim, block_q))
    _grouped_outer[grid](
        left, right, out, offs, p_dim, q_dim, scale, left.stride(0), left.stride(1), right.stride(0), right.stride(1),
        *out.stride(), DOT_FP32=interpreting() and left.dtype == torch.bfloat16, BLOCK_T=64, BLOCK_P=block_p,
        BLOCK_Q=block_q, num_warps=4, num_stages=3)
    return out


class MoeLoraFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, counts, w, a, b, scale):
        tiles = tile_map(counts, x.shape[0])
        ctx.save_for_backward(x, w, a, b, *tiles)
        ctx.scale = scale
        return grouped_lora_mm(x, w, a, b, scale, tiles)

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b, *tiles = ctx.saved_tensors
        dy = dy.contiguous()
        s = ctx.scale
        if a is None:
            return grouped_lora_mm(dy, w.transpose(1, 2), None, None, s, tiles), None, None, None, None, None
        dx = grouped_lora_mm(dy, w.transpose(1, 2), b.transpose(1, 2), a.transpose(1, 2), s, tiles)
        dy_bt = grouped_lora_mm(dy, b.transpose(1, 2), None, None, 1.0, tiles)  # dY B^T  [N, r]
        xa = grouped_lora_mm(x, a, None, None, 1.0, tiles)  # X A  [N, r]
        offs = tiles[2]
        da = grouped_outer(x, dy_bt, offs, s, a.dtype)
        db = grouped_outer(xa, dy, offs, s, b.dtype)
        return dx, None, None, da, db, None


def compile_sm90(d_in: int, d_out: int, rank: int) -> dict:
    """Shared memory (bytes) of both kernels built for sm_90 in bf16 at these widths: a compile-only check."""
    from moetune.kernels.testing import compile_for_sm90

    mm_types = {name: "*bf16" for name in ("X", "W", "A", "B", "Y")}
    mm_types.update(TILE_EXPERT="*i32", TILE_ROW="*i64", OFFS="*i64", scale="fp32")
    mm_types.update({n: "i32" for n in _grouped_lora_mm.arg_names if n not in mm_types})
    mm_meta = {"HAS_LORA": True, "DOT_FP32": False, "BLOCK_M": BLOCK_M, "BLOCK_N": _block(d_out, 128),
               "BLOCK_K": _block(d_in, 64), "BLOCK_R": _rank_block(rank)}
    outer_types = {"L": "*bf16", "R": "*bf16", "OUT": "*bf16", "OFFS": "*i64", "scale": "fp32"}
    outer_types.update({n: "i32" for n in _grouped_outer.arg_names if n not in outer_types})
    outer_meta = {"DOT_FP32": False, "BLOCK_T": 64, "BLOCK_P": _block(d_in, 64), "BLOCK_Q": _block(rank, 64)}
    return {
        "grouped_lora_mm": compile_for_sm90(_grouped_lora_mm, mm_types, mm_meta, num_stages=3).metadata.shared,
        "grouped_outer": compile_for_sm90(_grouped_outer, outer_types, outer_meta, num_stages=3).metadata.shared,
    }
