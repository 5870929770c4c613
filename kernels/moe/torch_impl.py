"""The PyTorch path: three grouped GEMMs (torch's grouped_mm runs forward and backward on CPU and CUDA), autograd
gives dX, dA and dB; no dW is ever formed, nor W + ΔW. A quantized W runs expert by expert (moe_lora_per_expert,
also the EP engine's per-expert path), each dequantized a tile of rows at a time.

The frozen W [E, out, in] goes through FrozenLinear, which keeps W itself for the backward, never a view of it: a
ZeRO-3 Parameter then frees its gathered storage after the forward, and DeepSpeed gathers it again before the
module's backward (its hooks refetch every parameter of a module whose outputs get a gradient). A saved view would
keep each layer's gathered experts alive until the backward. DeepSpeed's own ZeRO-3 linear does the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.quant import QuantizedWeight, quantized_linear

_ALIGN_BYTES = 16  # grouped_mm wants every stride a multiple of 16 bytes
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # absent in older torch


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return (n * dtype.itemsize) % _ALIGN_BYTES == 0


def _times(x, w, offs, expert: int | None, transposed: bool):
    """x times w (transposed: wᵀ) for w [E, out, in]: expert `expert`'s alone, else grouped by the offsets."""
    if expert is not None:
        return x @ (w[expert].transpose(0, 1) if transposed else w[expert])
    return _grouped_mm(x, w.transpose(1, 2) if transposed else w, offs=offs)


class FrozenLinear(torch.autograd.Function):
    """y = x Wᵀ for a frozen w [E, out, in] (the module's Parameter itself), rows grouped by expert end offsets
    `offs`, or all of them expert `expert`'s; dX = dY W in the backward, W gets no gradient."""

    @staticmethod
    def forward(ctx, x, w, offs, expert):
        ctx.save_for_backward(w, offs)
        ctx.expert = expert
        return _times(x, w, offs, expert, transposed=True)

    @staticmethod
    def backward(ctx, dy):
        w, offs = ctx.saved_tensors
        return _times(dy.contiguous(), w, offs, ctx.expert, transposed=False), None, None, None


def moe_lora_per_expert(x_sorted, counts: list[int], w, lora_a, lora_b, scale: float, bias=None) -> torch.Tensor:
    """Expert after expert in x's dtype, in transformers' and PEFT's layouts: y_e = x_e W_eᵀ (+ bias_e)
    + s (x_e A_eᵀ) B_eᵀ for w [E, out, in] (dense, or a QuantizedWeight never dequantized whole), lora_a [E, r, in],
    lora_b [E, out, r] (or None), bias [E, out] (or None). Every expert runs, also with no rows, so that every
    factor is part of the graph."""
    out = []
    for e, xs in enumerate(torch.split(x_sorted, counts)):
        y = quantized_linear(xs, w.expert(e)) if isinstance(w, QuantizedWeight) else FrozenLinear.apply(xs, w, None, e)
        if bias is not None:
            y = y + bias[e]
        if lora_a is not None:
            y = y + scale * ((xs @ lora_a[e].transpose(0, 1)) @ lora_b[e].transpose(0, 1))
        out.append(y)
    return torch.cat(out)


def moe_lora_grouped_torch(x_sorted, counts, w, lora_a, lora_b, scale: float) -> torch.Tensor:
    """w [E, out, in] as stored (dense or a QuantizedWeight), lora_a [E, in, r], lora_b [E, r, out]."""
    d_out, d_in = w.shape[1:]
    grouped = _grouped_mm is not None and _aligned(d_in, x_sorted.dtype) and _aligned(d_out, x_sorted.dtype)
    if isinstance(w, QuantizedWeight) or not grouped:  # odd widths too: the loop, factors in PEFT's layout
        lora_a, lora_b = (None, None) if lora_a is None else (lora_a.transpose(1, 2), lora_b.transpose(1, 2))
        return moe_lora_per_expert(x_sorted, counts.tolist(), w, lora_a, lora_b, scale)
    offs = counts.cumsum(0).to(torch.int32)
    base = FrozenLinear.apply(x_sorted, w, offs, None)
    if lora_a is None:
        return base
    pad = -lora_a.shape[2] % (_ALIGN_BYTES // x_sorted.dtype.itemsize)  # zero rank columns change nothing
    a = F.pad(lora_a, (0, pad))
    b = F.pad(lora_b, (0, 0, 0, pad))
    return base + scale * _grouped_mm(_grouped_mm(x_sorted, a, offs=offs), b, offs=offs)
