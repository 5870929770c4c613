"""The PyTorch path: three grouped GEMMs (torch's grouped_mm runs forward and backward on CPU and CUDA), autograd
gives dX, dA and dB; W is detached so no dW is ever formed, nor W + ΔW. A quantized W runs expert by expert
(moe_lora_per_expert, also the EP engine's per-expert path), each dequantized a tile of rows at a time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.moe.reference import moe_lora_reference
from moetune.kernels.quant import QuantizedWeight, quantized_linear

_ALIGN_BYTES = 16  # grouped_mm wants every stride a multiple of 16 bytes
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # absent in older torch


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return (n * dtype.itemsize) % _ALIGN_BYTES == 0


def moe_lora_per_expert(x_sorted, counts: list[int], w, lora_a, lora_b, scale: float, bias=None) -> torch.Tensor:
    """Expert after expert in x's dtype, in transformers' and PEFT's layouts: y_e = x_e W_eᵀ (+ bias_e)
    + s (x_e A_eᵀ) B_eᵀ for w [E, out, in] (dense, or a QuantizedWeight never dequantized whole), lora_a [E, r, in],
    lora_b [E, out, r] (or None), bias [E, out] (or None). Every expert runs, also with no rows, so that every
    factor is part of the graph."""
    out = []
    for e, xs in enumerate(torch.split(x_sorted, counts)):
        y = quantized_linear(xs, w.expert(e)) if isinstance(w, QuantizedWeight) else xs @ w[e].transpose(0, 1)
        if bias is not None:
            y = y + bias[e]
        if lora_a is not None:
            y = y + scale * ((xs @ lora_a[e].transpose(0, 1)) @ lora_b[e].transpose(0, 1))
        out.append(y)
    return torch.cat(out)


def moe_lora_grouped_torch(x_sorted, counts, w, lora_a, lora_b, scale: float) -> torch.Tensor:
    if isinstance(w, QuantizedWeight):  # already [E, out, in]; the factors back to PEFT's layout
        lora_a, lora_b = (None, None) if lora_a is None else (lora_a.transpose(1, 2), lora_b.transpose(1, 2))
        return moe_lora_per_expert(x_sorted, counts.tolist(), w, lora_a, lora_b, scale)
    d_in, d_out = w.shape[1], w.shape[2]
    if _grouped_mm is None or not (_aligned(d_in, x_sorted.dtype) and _aligned(d_out, x_sorted.dtype)):
        return moe_lora_reference(x_sorted, counts, w, lora_a, lora_b, scale)  # odd widths: the per-expert loop
    offs = counts.cumsum(0).to(torch.int32)
    base = _grouped_mm(x_sorted, w.detach(), offs=offs)
    if lora_a is None:
        return base
    pad = -lora_a.shape[2] % (_ALIGN_BYTES // x_sorted.dtype.itemsize)  # zero rank columns change nothing
    a = F.pad(lora_a, (0, pad))
    b = F.pad(lora_b, (0, 0, 0, pad))
    return base + scale * _grouped_mm(_grouped_mm(x_sorted, a, offs=offs), b, offs=offs)
