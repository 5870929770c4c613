"""The PyTorch path: three grouped GEMMs (torch's grouped_mm runs forward and backward on CPU and CUDA), autograd
gives dX, dA and dB; W is detached so no dW is ever formed, nor W + ΔW."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetune.kernels.moe.reference import moe_lora_reference

_ALIGN_BYTES = 16  # grouped_mm wants every stride a multiple of 16 bytes
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)  # absent in older torch


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return (n * dtype.itemsize) % _ALIGN_BYTES == 0


def moe_lora_grouped_torch(x_sorted, counts, w, lora_a, lora_b, scale: float) -> torch.Tensor:
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
