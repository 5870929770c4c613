"""KDA (Kimi Delta Attention): chunkwise gated delta rule with per-channel decay.

`chunk_kda` takes the layout of transformers' `chunk_kimi_delta_attention` / fla's `chunk_kda`: q, k, g (B, T, H, K),
v (B, T, H, V), beta (B, T, H), states (N, H, K, V) in fp32. On CUDA it runs fla's `chunk_kda` (the maintained
kernel, chunk-parallel; the `[cuda]` extra) where fla is installed, else moetune's own Triton kernels;
MOETUNE_KDA_KERNEL=moetune|fla chooses (bench/gpu_check.py measures both). Elsewhere it runs the chunked PyTorch
implementation; `naive_recurrent_kda` is the token-by-token oracle.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .chunked import chunk_kda_torch
from .naive import naive_recurrent_kda

__all__ = ["chunk_kda", "chunk_kda_torch", "l2norm", "naive_recurrent_kda"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's normalisation (eps added under the square root), in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


KERNEL_SETTING = "MOETUNE_KDA_KERNEL"


def cuda_kda_kernel():
    """The CUDA implementation MOETUNE_KDA_KERNEL names: "fla" (fla.ops.kda.chunk_kda; the default where fla is
    installed) or "moetune" (kernels.kda.triton_kda; the default without fla)."""
    name = os.environ.get(KERNEL_SETTING) or ("fla" if importlib.util.find_spec("fla") else "moetune")
    if name == "fla":
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        return fla_chunk_kda
    if name == "moetune":
        from .triton_kda import chunk_kda_triton  # triton only where it compiles

        return chunk_kda_triton
    raise ValueError(f"{KERNEL_SETTING}={name!r}: expected 'fla' or 'moetune'")


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Returns (o in q's dtype, final state or None); `cu_seqlens` (N + 1 offsets, B = 1) packs N sequences."""
    dtype = q.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)  # kept in fp32, as transformers and fla do
    impl = cuda_kda_kernel() if q.is_cuda else chunk_kda_torch
    o, final_state = impl(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(dtype), final_state
