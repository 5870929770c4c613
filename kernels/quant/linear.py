"""y = x W^T over a frozen QuantizedWeight, dequantized one tile of output rows at a time in the forward and again
in the backward (dX = dY W), so the extra memory is one tile of dense weight and nothing dense is saved. W gets no
gradient: it is frozen, and any adapter (LoRA) lives outside."""

from __future__ import annotations

import math

import torch

from moetune.kernels.quant.weight import QuantizedWeight

TILE_ROWS = 256


def _tiles(qweight: QuantizedWeight, tile_rows: int):
    out = qweight.shape[-2]
    for start in range(0, out, tile_rows):
        yield slice(start, min(start + tile_rows, out))


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
        # fp32 across tiles, so that bf16 rounds once per element, like one matmul over all rows
        grad_x = grad_y.new_zeros(*grad_y.shape[:-1], qweight.shape[-1], dtype=torch.float32)
        for rows in _tiles(qweight, ctx.tile_rows):
            grad_x += grad_y[..., rows] @ qweight.dequantize(rows, grad_y.dtype)
        return grad_x.to(grad_y.dtype), None, None


def quantized_linear(x: torch.Tensor, qweight: QuantizedWeight, tile_rows: int | None = None) -> torch.Tensor:
    """x [..., in] @ W^T for a 2D [out, in] qweight -> [..., out] in x's dtype (tiles dequantized to it). tile_rows:
    output rows per dequantized tile, a multiple of qweight.row_align (default 256 rounded up to it)."""
    if len(qweight.shape) != 2 or x.shape[-1] != qweight.shape[-1]:
        raise ValueError(f"x {tuple(x.shape)} cannot multiply a weight {tuple(qweight.shape)}: it must be 2D "
                         "[out, in] (one expert: qweight.expert(e)) with in = x.shape[-1]")
    align = qweight.row_align
    tile_rows = tile_rows or math.ceil(TILE_ROWS / align) * align
    if tile_rows % align:
        raise ValueError(f"tile_rows={tile_rows} is not a multiple of {type(qweight).__name__}'s {align} rows")
    return _QuantizedLinear.apply(x, qweight, tile_rows)
