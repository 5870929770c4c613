"""Grouped GEMM over experts with the LoRA update fused in, in Triton.

Rows arrive sorted by expert. A small tile map (built on the device, no host sync) names, for each BLOCK_M tile of
rows, its expert and first row; tiles past the real count exit at once, and experts with no tokens own no tile.
  _grouped_lora_mm:  Y[rows] = X[rows] W_e (+ s (X[rows] A_e) B_e), the rank-r product accumulated in the same K loop
  _grouped_outer:    OUT_e = s * L[rows of e]^T R[rows of e]  (the per-expert reductions behind dA and dB)
The backward reuses _grouped_lora_mm on transposed views: dX = dY W^T + s (dY B^T) A^T.
W may be a frozen QuantizedWeight (FP8 block, INT4 pack-quantized, MXFP4; kernels.quant): _grouped_lora_mm then
reads its codes and scales and dequantizes each [BLOCK_K, BLOCK_N] tile in registers, so no dense W ever exists.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from moetune.kernels.quant import Fp8BlockWeight, Int4PackedWeight, Mxfp4Weight, QuantizedWeight
from moetune.kernels.quant.mxfp4 import GROUP as MXFP4_GROUP

BLOCK_M = 64
# The fused kernel holds the whole LoRA rank in one tile: on sm_90 rank 128 needs 123 KB of shared memory, 256
# spills registers and 512 needs 270 KB (over the 227 KB a block may have). Beyond this rank xA and (xA)B run as
# grouped GEMMs of their own, whose N tiles cap the rank like any width.
FUSED_RANK_MAX = 128
DENSE, FP8, INT4, MXFP4 = map(tl.constexpr, range(4))  # _grouped_lora_mm's FMT (constexpr: read by the kernel)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dequant_tile(W, WS, e, kk, nn, mask, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c,
                  FMT: tl.constexpr, W_T: tl.constexpr, GROUP_R: tl.constexpr, GROUP_C: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile (rows kk, columns nn) of the logical [K, N] operand in fp32, from the stored
    [out, in] codes W and scales WS of expert e (bit layouts: kernels.quant). Element (k, n) is stored at
    (row, col) = (k, n), or (n, k) with W_T: the forward reads the weight transposed (K = in), dX as it is."""
    if W_T:
        row, col = nn[None, :], kk[:, None]
    else:
        row, col = kk[:, None], nn[None, :]
    codes = W + e * sw_e + row * sw_r
    scales = WS + e * ss_e + (row // GROUP_R) * ss_r + (col // GROUP_C) * ss_c  # one scale per GROUP_R x GROUP_C
    if FMT == FP8:
        w = tl.load(codes + col * sw_c, mask=mask, other=0.0).to(tl.float32) * tl.load(scales, mask=mask, other=0.0)
    elif FMT == INT4:  # eight codes per int32 word, element c at bits 4 (c % 8), stored as q + 8
        word = tl.load(codes + (col // 8) * sw_c, mask=mask, other=0)
        q = ((word >> 4 * (col % 8)) & 0xF) - 8
        w = q.to(tl.float32) * tl.load(scales, mask=mask, other=0.0).to(tl.float32)  # exact in fp32
    else:  # MXFP4: two e2m1 codes per byte, low nibble first; one e8m0 scale per 32 elements
        code = (tl.load(codes + (col // 2) * sw_c, mask=mask, other=0).to(tl.int32) >> 4 * (col % 2)) & 0xF
        exponent, mantissa = (code >> 1) & 3, (code & 1).to(tl.float32)
        # e2m1: exponent 0 is subnormal (m / 2), else (1 + m / 2) * 2**(exponent - 1); bit 3 is the sign
        magnitude = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * ((1 << exponent) >> 1))
        # e8m0 s is a bare fp32 exponent field: 2**(s - 127) has the bits s << 23 (s = 0: the subnormal 2**-127)
        s = tl.load(scales, mask=mask, other=127).to(tl.int32)
        w = tl.where(code >= 8, -magnitude, magnitude) * tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)
    return w


@triton.jit
def _grouped_lora_mm(
    X, W, WS, A, B, Y, TILE_EXPERT, TILE_ROW, OFFS,
    d_in, d_out, rank, scale,
    sx_n, sx_k, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c, sa_e, sa_k, sa_r, sb_e, sb_r, sb_n, sy_n, sy_m,
    FMT: tl.constexpr, W_T: tl.constexpr, GROUP_R: tl.constexpr, GROUP_C: tl.constexpr,
    HAS_LORA: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """FMT DENSE: W [E, K, N] by its strides (sw_r over K, sw_c over N), WS unused. Otherwise W and WS are a
    quantized weight's codes and scales, dequantized tile by tile (_dequant_tile)."""
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
        w_mask = k_mask[:, None] & col_mask[None, :]
        if FMT == DENSE:
            w = tl.load(W + e * sw_e + kk[:, None] * sw_r + cols[None, :] * sw_c, mask=w_mask, other=0.0)
        else:  # rounded once to the compute dtype, as kernels.quant's dequantize(dtype=x.dtype) rounds
            w = _dequant_tile(W, WS, e, kk, cols, w_mask, sw_e, sw_r, sw_c, ss_e, ss_r, ss_c,
                              FMT, W_T, GROUP_R, GROUP_C).to(X.dtype.element_ty)
        if DOT_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w)
        if HAS_LORA:
            a = tl.load(A + e * sa_e + kk[:, None] * sa_k + r[None, :] * sa_r,
                        mask=k_mask[:, None] & (r[None, :] < rank), other=0.0)
            xa += tl.dot(x, a.to(x.dtype))
    if HAS_LORA:
        b = tl.load(B + e * sb_e + r[:, None] * sb_r + cols[None, :] * sb_n,
                    mask=(r[:, None] < rank) & col_mask[None, :], other=0.0)
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


def _operand(w, transpose: bool):
    """The [E, K, N] operand of _grouped_lora_mm: (W, WS and their strides, constexprs, K, N). A dense w is [E, K, N]
    by its strides (transpose: its [E, N, K] view); a QuantizedWeight is [E, out, in], read transposed (K = in) in
    the forward and as stored (K = out) for dX."""
    if not isinstance(w, QuantizedWeight):
        w = w.transpose(1, 2) if transpose else w
        return (w, w, *w.stride(), 0, 0, 0), dict(FMT=DENSE, W_T=False, GROUP_R=1, GROUP_C=1), *w.shape[1:]
    if isinstance(w, Fp8BlockWeight):
        fmt, codes, scales, group = FP8, w.weight, w.weight_scale_inv, w.block
    elif isinstance(w, Int4PackedWeight) and w.weight_zero_point is None:
        fmt, codes, scales, group = INT4, w.weight_packed, w.weight_scale, (1, w.shape[2] // w.weight_scale.shape[2])
    elif isinstance(w, Mxfp4Weight):
        fmt, codes, scales, group = MXFP4, w.blocks.flatten(-2), w.scales, (1, MXFP4_GROUP)  # a row's in/2 bytes
    else:
        raise TypeError(f"no kernel reads {type(w).__name__} (asymmetric INT4 runs on the torch backend)")
    out, d_in = w.shape[1:]
    meta = dict(FMT=fmt, W_T=transpose, GROUP_R=group[0], GROUP_C=group[1])
    return (codes, scales, *codes.stride(), *scales.stride()), meta, *((d_in, out) if transpose else (out, d_in))


def grouped_lora_mm(x, w, a, b, scale: float, tiles, out_dtype=None, transpose: bool = False):
    """x [N, K] sorted by expert, w the [E, K, M] operand (_operand), a [E, K, r] / b [E, r, M] or None -> [N, M]."""
    if a is not None and a.shape[2] > FUSED_RANK_MAX:
        xa = grouped_lora_mm(x, a, None, None, 1.0, tiles)  # rounded to x's dtype, as the fused kernel rounds xA
        y = grouped_lora_mm(x, w, None, None, 1.0, tiles, torch.float32, transpose)
        y += scale * grouped_lora_mm(xa, b, None, None, 1.0, tiles, torch.float32)  # summed in fp32, as fused
        return y.to(out_dtype or x.dtype)
    expert, first_row, offs = tiles
    w_args, w_meta, d_in, d_out = _operand(w, transpose)
    y = torch.empty(x.shape[0], d_out, dtype=out_dtype or x.dtype, device=x.device)
    has_lora = a is not None
    a_, b_ = (a, b) if has_lora else w_args[:2]  # unused pointers when there is no LoRA
    rank = a.shape[2] if has_lora else 0
    block_n = _block(d_out, 128)
    grid = (expert.numel(), triton.cdiv(d_out, block_n))
    _grouped_lora_mm[grid](
        x, *w_args[:2], a_, b_, y, expert, first_row, offs, d_in, d_out, rank, scale,
        x.stride(0), x.stride(1), *w_args[2:], *a_.stride(), *b_.stride(), y.stride(0), y.stride(1), **w_meta,
        HAS_LORA=has_lora, DOT_FP32=interpreting() and x.dtype == torch.bfloat16, BLOCK_M=BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=_block(d_in, 64), BLOCK_R=_rank_block(rank), num_warps=4, num_stages=3)
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
    """y = x Wᵀ + s (x A) B per expert; w [E, Dout, Din] as stored, dense (kept itself for the backward, never a
    view: see kernels.moe.torch_impl.FrozenLinear) or a QuantizedWeight; frozen either way."""

    @staticmethod
    def forward(ctx, x, counts, w, a, b, scale):
        tiles = tile_map(counts, x.shape[0])
        ctx.qweight = w if isinstance(w, QuantizedWeight) else None  # no tensor: held like kernels.quant's linear
        # x only where LoRA's gradients need it: frozen experts' dX needs W and dY alone
        ctx.save_for_backward(None if a is None else x, None if ctx.qweight is not None else w, a, b, *tiles)
        ctx.scale = scale
        return grouped_lora_mm(x, w, a, b, scale, tiles, transpose=True)

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b, *tiles = ctx.saved_tensors
        w = w if ctx.qweight is None else ctx.qweight  # dX multiplies by W as stored, [E, Dout, Din]
        dy = dy.contiguous()
        s = ctx.scale
        if a is None:
            return grouped_lora_mm(dy, w, None, None, s, tiles), None, None, None, None, None
        dx = grouped_lora_mm(dy, w, b.transpose(1, 2), a.transpose(1, 2), s, tiles)
        dy_bt = grouped_lora_mm(dy, b.transpose(1, 2), None, None, 1.0, tiles)  # dY B^T  [N, r]
        xa = grouped_lora_mm(x, a, None, None, 1.0, tiles)  # X A  [N, r]
        offs = tiles[2]
        da = grouped_outer(x, dy_bt, offs, s, a.dtype)
        db = grouped_outer(xa, dy, offs, s, b.dtype)
        return dx, None, None, da, db, None
