"""Which CUDA implementation runs a grouped LoRA GEMM: torch's grouped_mm (cuBLAS/CUTLASS grouped GEMMs, the
LoRA as two more) or the Triton kernel with the LoRA fused in. The Triton kernel is the only one that reads a
quantized weight in its own format; for dense weights the faster one per shape is taken from MEASURED, which the
device benchmark fills (bench/gpu_check.py reports both per shape), and grouped_mm for large shapes otherwise.
"""

from __future__ import annotations

import torch

from moetune.kernels.moe.torch_impl import _aligned

# (d_in, d_out) -> "triton" or "torch", from bench/gpu_check.py's MoE benchmark on an H200 (none measured yet)
MEASURED: dict[tuple[int, int], str] = {}
LARGE = 1024 * 1024  # d_in * d_out from which grouped_mm is the default where nothing was measured


def cuda_backend(x: torch.Tensor, w, quantized: bool) -> str:
    """"triton" or "torch" for x [N, d_in] times the stored w [E, d_out, d_in] on CUDA."""
    if quantized:
        return "triton"
    d_out, d_in = w.shape[1], w.shape[2]
    aligned = _aligned(d_in, x.dtype) and _aligned(d_out, x.dtype)
    # torch's CUDA grouped_mm takes bf16 on Hopper (sm_90) and later
    grouped_mm_runs = aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    if not grouped_mm_runs:
        return "triton"
    return MEASURED.get((d_in, d_out), "torch" if d_in * d_out >= LARGE else "triton")
