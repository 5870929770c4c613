"""Autograd wrapper and backend choice: the Triton kernels on CUDA tensors (and, when asked, on CPU tensors under
TRITON_INTERPRET=1), shapes only on the meta device unless one is named, the PyTorch path (torch_impl) everywhere
else. All save only (q, k, v, indices, out, lse)."""

from __future__ import annotations

import torch

from moetune.kernels.sparse_attention import torch_impl


class _ShapesOnly:
    """The meta device's backend (the memory planner's forward): outputs of the right shapes, nothing computed;
    the autograd function saves what it saves on a device."""

    @staticmethod
    def forward(q, k, v, indices, scale):
        return q.new_empty(*q.shape[:3], v.shape[3]), q.new_empty(q.shape[:3], dtype=torch.float32)

    @staticmethod
    def backward(q, k, v, indices, scale, out, lse, grad_out):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _backend(name: str | None, device: torch.device):
    if name is None and device.type == "meta":  # a named backend on meta: compile_check captures its launches
        return _ShapesOnly
    if name is None:
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from moetune.kernels.sparse_attention import triton_impl

        return triton_impl
    if name == "torch":
        return torch_impl
    raise ValueError(f"unknown sparse attention backend {name!r} (expected 'triton' or 'torch')")


class SparseAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, backend):
        impl = _backend(backend, q.device)
        out, lse = impl.forward(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale, ctx.impl = scale, impl
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, indices, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.impl.backward(q, k, v, indices, ctx.scale, out, lse, grad_out)
        return dq, dk, dv, None, None, None


def sparse_attention(q, k, v, indices, scale: float | None = None, gate=None, backend: str | None = None):
    """Attention of each query over its selected keys only.

    q [B,T,H,Dk], k [B,S,Hkv,Dk], v [B,S,Hkv,Dv] with H a multiple of Hkv; indices [B,T,K] (unique per row, -1 = no
    key; causality is the selector's job). A query without any valid key outputs zeros. `gate`, broadcastable to the
    output [B,T,H,Dv], applies the output gate out * sigmoid(gate). backend: None (by device), "triton" or "torch".
    """
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out = SparseAttentionFn.apply(q, k, v, indices, scale, backend)
    if gate is not None:
        out = out * torch.sigmoid(gate).to(out.dtype)
    return out
