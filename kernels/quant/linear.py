"""y = x W^T over a frozen QuantizedWeight, never with the whole dense W, in PyTorch: tiles of output rows, as many
as TILE_BYTES of dense fp32 allows, dequantized one at a time in the forward and again in the backward (dX = dY W).
dX sums every tile's exact fp32 product in fp32 and rounds once per element, like one matmul over all rows (bf16
tile partials would round at every tile). On CUDA a frozen quantized linear runs kernels.moe's Triton kernel with
one expert instead (kernels/moe/linear.py, QuantizedLinear); the per-expert loop of kernels.moe runs this.
Nothing dense is saved for the backward. W gets no gradient: it is frozen, and any adapter (LoRA) lives outside."""

from __future__ import annotations

import torch

from moetune.kernels.quant.weight import QuantizedWeight

# Dense fp32 bytes of one tile: its weight rows plus the gradient columns they meet in the backward (a 7168-wide
# FP8 weight at 8K tokens: 1,024 rows a tile; it was 256 whatever the memory).
TILE_BYTES = 64 * 2**20


def _tiles(qweight: QuantizedWeight, tile_rows: int):
    out = qweight.shape[-2]
    for start in range(0, out, tile_rows):
        yield slice(start, min(start + tile_rows, out))


def _tile_rows(qweight: QuantizedWeight, tokens: int) -> int:
    """The most rows (a multiple of the format's alignment) whose fp32 tile and dY columns fit TILE_BYTES."""
    align, (out, d_in) = qweight.row_align, qweight.shape
    rows = TILE_BYTES // (4 * (d_in + tokens)) // align * align
    return min(max(rows, align), -(-out // align) * align)


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qweight, tile_rows):
        ctx.qweight, ctx.tile_rows = qweight, tile_rows
        y = x.new_empty(*x.shape[:-1], qweight.shape[-2])
        for rows in _tiles(qweight, tile_rows):
            y[..., rows] = x @ qweight.dequantize(rows, x.dtype).T
        return y

    @staticmethod
    def backward(ctx, grad_y):
        qweight = ctx.qweight
        grad_x = grad_y.new_zeros(*grad_y.shape[:-1], qweight.shape[-1], dtype=torch.float32)
        for rows in _tiles(qweight, ctx.tile_rows):  # the weight as the forward rounded it, multiplied in fp32
            grad_x += grad_y[..., rows].float() @ qweight.dequantize(rows, grad_y.dtype).float()
        return grad_x.to(grad_y.dtype), None, None


def quantized_linear(x: torch.Tensor, qweight: QuantizedWeight, tile_rows: int | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for a 2D [out, in] qweight -> [..., out] in x's dtype (W dequantized to it). tile_rows:
    output rows per dequantized tile, a multiple of qweight.row_align (default: sized by TILE_BYTES)."""
    if len(qweight.shape) != 2 or x.shape[-1] != qweight.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)} cannot multiply a weight {tuple(qweight.shape)}: it must be 2D "
                         "[out, in] (one expert: qweight.expert(e)) with in = x.shape[-1]")
    align = qweight.row_align
    tile_rows = tile_rows or _tile_rows(qweight, x.numel() // x.shape[-1])
    if tile_rows % align:
        raise ValueError(f"tile_rows={tile_rows} is not a multiple of {type(qweight).__name__}'s {align} rows")
    return _QuantizedLinear.apply(x, qweight, tile_rows)
