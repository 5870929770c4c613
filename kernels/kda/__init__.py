"""KDA (Kimi Delta Attention): chunkwise gated delta rule with per-channel decay, and Gated DeltaNet, the same rule
with one decay per head (`chunk_gated_delta_rule`).

`chunk_kda` takes the layout of transformers' `chunk_kimi_delta_attention` / fla's `chunk_kda`: q, k, g (B, T, H, K),
v (B, T, H, V), beta (B, T, H), states (N, H, K, V) in fp32. `chunk_gated_delta_rule` takes transformers'
`torch_chunk_gated_delta_rule` / fla's: q, k (B, T, H, K), v (B, T, HV, V), g and beta (B, T, HV), every H-th value
head sharing one query/key head (HV a multiple of H).

On CUDA both run fla (`fla.ops.kda.chunk_kda`, `fla.ops.gated_delta_rule.chunk_gated_delta_rule`; the `[cuda]`
extra): chunk-parallel, maintained. fla normalises q and k itself (`use_qk_l2norm_in_kernel`), in their own dtype, so
every operand its kernels multiply has the model's dtype (fp32 q/k against bf16 v fail to build). Gates known to lie
in [lower_bound, 0) (a bounded sigmoid gate) take fla's `safe_gate` path (tensor-core intra-chunk work).
moetune's own Triton kernel (kernels/kda/triton_kda.py: one program per sequence and head, serial over chunks) serves
only where fla cannot: a CUDA machine without fla installed, or MOETUNE_KDA_KERNEL=moetune (bench/gpu_check.py
measures both). Elsewhere (CPU) the chunked PyTorch implementation runs; `naive_recurrent_kda` is the token-by-token
oracle.

Packed sequences: fla keeps its chunk bookkeeping for `cu_seqlens` in caches keyed by the tensor's identity, and
builds it from the host copy (`cu_seqlens_cpu`) where it has one, else by reading the device (a host sync). A
micro-batch's offsets therefore go to the device once, as `packed_offsets` makes them (int64, the host copy
attached), and every layer, and its recompute, hands fla that same tensor.

`recurrent_kda` is generation's step (a token or a few per row on each row's cached state): fla's
`fused_recurrent_kda` on CUDA where fla is chosen, else `recurrent_kda_torch` (every row and head at once, a loop
over the tokens only). Both take the gate already computed: fla's `lower_bound` applies only where its kernel
computes the gate itself from raw inputs (`use_gate_in_kernel`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from .chunked import chunk_kda_torch
from .naive import naive_recurrent_kda
from .recurrent import recurrent_kda_torch

__all__ = ["chunk_gated_delta_rule", "chunk_kda", "chunk_kda_torch", "l2norm", "naive_recurrent_kda", "offsets_on_host",
           "packed_offsets", "recurrent_kda", "recurrent_kda_torch"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's normalisation (eps added under the square root), in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


KERNEL_SETTING = "MOETUNE_KDA_KERNEL"
_HOST_COPY = "_moetune_host_copy"  # the attribute packed_offsets attaches to the device tensor


def packed_offsets(offsets: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A micro-batch's packed-sequence offsets (N + 1, on the host) as every layer takes them: int64 on `device`,
    carrying their host copy for fla (`cu_seqlens_cpu`)."""
    host = offsets.to(torch.long)
    on_device = host.to(device)
    if on_device is not host:
        setattr(on_device, _HOST_COPY, host)
    return on_device


def offsets_on_host(offsets: torch.Tensor, read_back: bool = True) -> torch.Tensor | None:
    """`offsets` on the host: themselves there, else the copy packed_offsets attached, else (`read_back`) read
    from the device (a host sync) or None."""
    if offsets.device.type == "cpu":
        return offsets
    host = getattr(offsets, _HOST_COPY, None)
    return offsets.cpu() if host is None and read_back else host


def _fla_offsets(cu_seqlens: torch.Tensor | None) -> dict:
    """fla's cu_seqlens (int64: packed_offsets' tensor itself, so fla's identity-keyed caches hit in every layer)
    and cu_seqlens_cpu (the host copy where there is one: fla then reads nothing back; else fla reads once, cached)."""
    if cu_seqlens is None:
        return {"cu_seqlens": None, "cu_seqlens_cpu": None}
    host = offsets_on_host(cu_seqlens, read_back=False)
    return {"cu_seqlens": cu_seqlens.long(), "cu_seqlens_cpu": None if host is None else host.long()}


def _cuda_kernel_name() -> str:
    name = os.environ.get(KERNEL_SETTING) or ("fla" if importlib.util.find_spec("fla") else "moetune")
    if name not in ("fla", "moetune"):
        raise ValueError(f"{KERNEL_SETTING}={name!r}: expected 'fla' or 'moetune'")
    return name


def _normalising(impl):
    """`impl` (chunk_kda_torch's contract) behind chunk_kda's: q and k l2-normalised first where asked."""

    @functools.wraps(impl)
    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, lower_bound=None):
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)  # kept in fp32, as transformers does; these kernels compute in fp32
        return impl(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    return run


def _fla_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, lower_bound=None):
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    return fla_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         safe_gate=lower_bound is not None, lower_bound=lower_bound, **_fla_offsets(cu_seqlens))


def cuda_kda_kernel():
    """The CUDA implementation MOETUNE_KDA_KERNEL names, with chunk_kda's contract: "fla" (the default where fla is
    installed) or "moetune" (kernels.kda.triton_kda; the default without fla)."""
    if _cuda_kernel_name() == "fla":
        importlib.import_module("fla.ops.kda")  # asked for and missing: fails here, never a silent fallback
        return _fla_kda
    from .triton_kda import chunk_kda_triton  # triton only where it compiles

    return _normalising(chunk_kda_triton)


def kda_kernel(device: torch.device | str):
    """chunk_kda's implementation for tensors on `device`."""
    return cuda_kda_kernel() if torch.device(device).type == "cuda" else _normalising(chunk_kda_torch)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, lower_bound=None):
    """Returns (o in q's dtype, final state or None); `cu_seqlens` (N + 1 offsets, B = 1) packs N sequences;
    `lower_bound`: every gate is known to lie in [lower_bound, 0) (a speed hint for fla, exact either way)."""
    o, final_state = kda_kernel(q.device)(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                          lower_bound=lower_bound)
    return o.to(q.dtype), final_state


def _fla_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False):
    from fla.ops.kda import fused_recurrent_kda

    return fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _torch_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    return recurrent_kda_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state)


def recurrent_kda_kernel(device: torch.device | str):
    """recurrent_kda's implementation for tensors on `device`: fla's where chunk_kda runs fla's, else PyTorch's."""
    if torch.device(device).type == "cuda" and _cuda_kernel_name() == "fla":
        importlib.import_module("fla.ops.kda")
        return _fla_recurrent_kda
    return _torch_recurrent_kda


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False):
    """Equal-length rows, token by token, on their states (N = B): layouts and results as chunk_kda's (o in q's
    dtype, final state (B, H, K, V) fp32 or None)."""
    o, final_state = recurrent_kda_kernel(q.device)(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                    output_final_state=output_final_state,
                                                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.to(q.dtype), final_state


def _fla_gated_delta(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    return fla_chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **_fla_offsets(cu_seqlens))


def _on_kda(kda, gate_per_channel: bool):
    """Gated DeltaNet on a KDA implementation: query/key heads repeated for their value heads, the head's decay as
    one gate channel that chunk_kda_torch broadcasts over K (`gate_per_channel`: spelled out, for the Triton
    kernel)."""

    def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None):
        if use_qk_l2norm_in_kernel:  # before the repeat: each query/key head normalised once (as _normalising)
            q, k = l2norm(q), l2norm(k)
        group = v.shape[2] // q.shape[2]
        q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
        g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1] if gate_per_channel else 1)
        return kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                   cu_seqlens=cu_seqlens)

    return run


def gated_delta_kernel(device: torch.device | str):
    """chunk_gated_delta_rule's implementation for tensors on `device`: fla's own on CUDA where chosen, else KDA's."""
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and _cuda_kernel_name() == "fla":
        importlib.import_module("fla.ops.gated_delta_rule")
        return _fla_gated_delta
    return _on_kda(kda_kernel(device), gate_per_channel=on_cuda)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Returns (o (B, T, HV, V) in q's dtype, final state (N, HV, K, V) or None); `cu_seqlens` as in chunk_kda."""
    o, final_state = gated_delta_kernel(q.device)(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                  output_final_state=output_final_state,
                                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                                  cu_seqlens=cu_seqlens)
    return o.to(q.dtype), final_state
