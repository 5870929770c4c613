"""The expert compute with LoRA, y = xW + s·(xA)B per expert, and its backend choice: on CUDA the Triton kernels or
torch's grouped_mm, per shape (kernels.moe.choice), torch's grouped_mm elsewhere. W is frozen in every path: it
never receives a gradient and W + ΔW is never formed. Autograd keeps the frozen weight itself for the backward,
never a view of it (kernels.moe.torch_impl.FrozenLinear says why: ZeRO-3).
A quantized W (kernels.quant) is dequantized tile by tile inside the Triton kernel, or expert by expert in torch."""

from __future__ import annotations

import torch

from moetune.kernels.moe.choice import cuda_backend
from moetune.kernels.moe.torch_impl import moe_lora_grouped_torch
from moetune.kernels.quant import Int4PackedWeight, QuantizedWeight


def moe_lora_grouped(x_sorted, counts, w, lora_a, lora_b, scale: float, backend: str | None = None) -> torch.Tensor:
    """x_sorted [N, Din]: the routed token copies grouped by local expert (counts[e] rows for expert e, in expert
    order; zero is fine); w [E, Din, Dout] (frozen; a transposed view of a [E, Dout, Din] weight works as is), or a
    QuantizedWeight in its own [E, Dout, Din] layout; lora_a [E, Din, r]; lora_b [E, r, Dout] (both None: no
    adapter). Returns [N, Dout]; gradients flow to x_sorted, lora_a and lora_b. backend: None (by device),
    "triton" or "torch"."""
    stored = w if isinstance(w, QuantizedWeight) else w.transpose(1, 2)
    return moe_lora_linear(x_sorted, counts, stored, lora_a, lora_b, scale, backend)


def moe_lora_linear(x_sorted, counts, weight, lora_a, lora_b, scale: float, backend: str | None = None):
    """moe_lora_grouped with the frozen weight as a module stores it, [E, Dout, Din] (F.linear's layout; a
    QuantizedWeight is always so): pass the Parameter itself, which is what autograd then keeps."""
    experts = [t.shape[0] for t in (weight, lora_a, lora_b) if t is not None]
    if counts.numel() != weight.shape[0] or len(set(experts)) != 1 or (lora_a is None) != (lora_b is None):
        raise ValueError(f"counts ({counts.numel()}), w, lora_a and lora_b must agree on the number of experts "
                         f"({experts}) and lora_a/lora_b come together")
    quantized = isinstance(weight, QuantizedWeight)
    if backend is None:
        backend = cuda_backend(x_sorted, weight, quantized) if x_sorted.device.type == "cuda" else "torch"
    if backend == "triton" and isinstance(weight, Int4PackedWeight) and weight.weight_zero_point is not None:
        backend = "torch"  # the kernel reads symmetric INT4 only (the MoE checkpoints); a zero point runs per expert
    if backend == "torch":
        return moe_lora_grouped_torch(x_sorted, counts, weight, lora_a, lora_b, scale)
    if backend == "triton":
        from moetune.kernels.moe.triton_impl import MoeLoraFn

        return MoeLoraFn.apply(x_sorted.contiguous(), counts, weight, lora_a, lora_b, scale)
    raise ValueError(f"unknown MoE backend {backend!r} (expected 'triton' or 'torch')")
