"""The fused kernels as the job's workers run them, for the planner's forward on the meta device: each saves for the
backward what the device's kernel saves, where the meta device would otherwise run the CPU path (which keeps fp32
intermediates a GPU kernel never holds).

- Attention (SDPA): a flash kernel keeps q, k, v, the output and its log-sum-exp (the meta device's math path would
  keep the [T, T] attention weights).
- KDA (kernels.kda.chunk_kda), for GPU workers: fla 0.6.0's `chunk_kda`, the CUDA path, with its default
  recomputation: it keeps q and k l2-normalised in their dtype with their fp32 inverse norms, v, β, the gates as
  given and their chunk-local cumulative sum in fp32, the intra-chunk matrices Aqk and Akk ([T, H, 64] in k's dtype)
  and the initial state; the inter-chunk states are recomputed in the backward (fla/ops/kda/chunk.py's
  save_for_backward, chunk_fwd.py's `disable_recompute=False` branch). The CPU path keeps every chunk's fp32
  intermediates instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from unittest import mock

import torch
from torch.nn.attention.bias import CausalBias

import moetune.kernels.kda as kda_module
from moetune.workers.planner import work

FLA_CHUNK = 64  # fla's KDA chunk size: the width of its intra-chunk matrices


@contextlib.contextmanager
def kernels_as_run_on(device_type: str) -> Iterator[None]:
    """Inside, SDPA on meta tensors saves what a flash kernel saves (the CPU's is one too), and on "cuda" KDA saves
    what fla's kernel saves (elsewhere the CPU path runs, as the workers run it); both report their operations to
    the counting planner.work."""
    cpu_kernel = kda_module.kda_kernel

    def kda_kernel(device):
        on_meta = device_type == "cuda" and torch.device(device).type == "meta"
        return partial(_counted_kda, _fla_kda if on_meta else cpu_kernel(device))

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.nn.functional.scaled_dot_product_attention", _flash_attention))
        stack.enter_context(mock.patch.object(kda_module, "kda_kernel", kda_kernel))
        yield


def _counted_kda(kernel, q, k, v, *args, **kwargs):
    work.add(flops=work.kda_flops(math.prod(v.shape[:3]), q.shape[-1], v.shape[-1], FLA_CHUNK))
    return kernel(q, k, v, *args, **kwargs)


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """Values narrower than the queries (MLA) are padded to their width, as a fused kernel holds them. A causal
    bias (a CP rank's queries over the whole row's keys) is the kernel's own causal flag, no tensor."""
    if isinstance(attn_mask, CausalBias):
        attn_mask, is_causal = None, True
    work.add(flops=work.attention_flops(math.prod(query.shape[:-2]), query.shape[-2], key.shape[-2],
                                        query.shape[-1] + value.shape[-1], is_causal))
    if enable_gqa:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    width = value.shape[-1]
    value = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0][..., :width]


def _fla_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, lower_bound=None):
    """kernels.kda.chunk_kda's contract on meta tensors: (o, final state or None)."""
    return _FlaKdaSaves.apply(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel)


class _FlaKdaSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, output_final_state, normalised):
        batch, tokens, heads = v.shape[:3]
        rows = (batch, tokens, heads)
        kept = [q, k]
        if normalised:  # new normalised copies and their inverse norms
            kept = [torch.empty_like(q), torch.empty_like(k), q.new_empty(q.shape[:3], dtype=torch.float32),
                    k.new_empty(k.shape[:3], dtype=torch.float32)]
        kept += [v, g, beta, g.new_empty(g.shape, dtype=torch.float32),
                 k.new_empty((*rows, FLA_CHUNK)), k.new_empty((*rows, FLA_CHUNK))]
        if initial_state is not None:
            kept.append(initial_state)
        ctx.save_for_backward(*kept)
        final = (v.new_empty((batch, heads, q.shape[-1], v.shape[-1]), dtype=torch.float32)
                 if output_final_state else None)
        return v.new_empty(v.shape, dtype=q.dtype), final

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("the planner's KDA stand-in runs forward only")
