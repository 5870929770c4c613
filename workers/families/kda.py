"""The KDA kernel swaps, without editing transformers: the families with Kimi Delta Attention layers run their
chunked core on `kernels.kda.chunk_kda` instead of transformers' `chunk_kimi_delta_attention`; those with Gated
DeltaNet layers (KDA with one decay per head) on `kernels.kda.chunk_gated_delta_rule` instead of
`torch_chunk_gated_delta_rule`. A family declares its layer class (`kda_swap`).
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from moetune.kernels.kda import chunk_gated_delta_rule, chunk_kda
from moetune.workers.comm.conv_halo import previous_tokens
from moetune.workers.comm.kda_context import context_parallel_kda
from moetune.workers.families.context import context_slice

# the swapped layer whose forward is running (None outside one)
_swapped_layer = contextvars.ContextVar("moetune_kda_swapped", default=None)


def _kda_core(stock, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_kimi_delta_attention contract, computed by `kernels.kda.chunk_kda`; packed sequences
    (`cu_seq_lens_q`, workers.families.segments) keep their own states. In a CP forward (workers.families.context)
    the state comes from the earlier ranks' slices."""
    layer = _swapped_layer.get()
    kda = functools.partial(chunk_kda, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            lower_bound=layer._moetune_gate_lower_bound)
    if (part := context_slice(layer)) is not None:
        if output_final_state:
            raise ValueError("a context-parallel forward keeps no cache")
        return context_parallel_kda(query, key, value, g, beta, part.layout, part.group,
                                    initial_state=initial_state, kda=kda), None
    return kda(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
               cu_seqlens=kwargs.get("cu_seq_lens_q"))


def _gated_delta_core(stock, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """transformers' torch_chunk_gated_delta_rule contract (the layer hands `cu_seq_lens_q` as `cu_seqlens`),
    computed by `kernels.kda.chunk_gated_delta_rule`."""
    if context_slice(_swapped_layer.get()) is not None:  # never a slice run as if it began its row
        raise NotImplementedError("Gated DeltaNet layers have no context-parallel path yet")
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)


def _short_conv(stock, hidden_states, weight, bias=None, activation=None, cu_seq_lens_q=None, **kwargs):
    """transformers' causal_conv1d_fn contract (a depthwise causal conv over [B, D, T]); with packed sequences no
    tap reaches across a boundary (transformers' fallback would mix a sequence's first tokens with the previous
    sequence's last ones). Off CUDA, one multiply-add per tap: PyTorch's CPU depthwise conv1d backward took 5.2 of
    a Gated DeltaNet layer's ~26 ms fwd+bwd at the image bench's shape (B 32, 128 channels, T 34).

    The taps run over [B, T, D], the layout the callers' [B, D, T] is a transposed view of, and the result goes back
    as the same kind of view: the multiply-adds and the activation (and their backward) then stream along
    contiguous channels. Over [B, D, T] they took 2.6 against 1.6 ms fwd+bwd with the SiLU at that shape."""
    part = context_slice(_swapped_layer.get())
    if cu_seq_lens_q is None and part is None and hidden_states.device.type == "cuda":
        return stock(hidden_states, weight, bias=bias, activation=activation, **kwargs)
    width = weight.shape[-1]
    x = hidden_states.transpose(1, 2).to(weight.dtype)
    # a CP slice: the taps before its first token read the previous rank's last inputs (zeros before its own row)
    halo = None if part is None else previous_tokens(x, width, part.layout, part.group)
    if cu_seq_lens_q is None:
        x, at = F.pad(x, (0, 0, width - 1, 0)), None
    else:
        x, at = _spaced(x, cu_seq_lens_q, width - 1)
    if halo is not None:  # in place of the first sequence's leading zeros
        x = torch.cat([halo, x[:, width - 1:]], dim=1)
    length = x.shape[1] - (width - 1)
    taps = weight.t()  # [width, D]
    out = taps[0] * x[:, :length] if bias is None else torch.addcmul(bias, taps[0], x[:, :length])
    for j in range(1, width):  # tap j reads position t - (width - 1 - j)
        out = torch.addcmul(out, taps[j], x[:, j:j + length])
    if at is not None:
        out = out.index_select(1, at)
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(hidden_states.dtype).transpose(1, 2)


def _spaced(x, cu_seq_lens, gap: int):
    """x [B, T, D] of packed sequences -> (the sequences each behind `gap` zeros, [B, T + gap · sequences, D];
    where each token's output lands in the conv over it). The conv then saves for backward what it saves for one
    unpacked row, the planner's measure (with frozen taps: the indices only); masking the taps per position instead
    saved a [D, width, T] tensor, 4x the bytes of x."""
    length = x.shape[1]
    starts = torch.zeros(length, dtype=torch.long, device=x.device)
    starts[cu_seq_lens[1:-1].long()] = 1
    at = torch.arange(length, device=x.device) + gap * starts.cumsum(0)
    spaced = x.new_zeros(x.shape[0], length + gap * (cu_seq_lens.numel() - 1), *x.shape[2:])
    spaced[:, at + gap] = x  # saves the index only (index_copy would save x as well)
    return spaced, at


# The layers' transformers functions (module-level in their modeling modules, looked up at call time) and ours
_OURS = {"chunk_kimi_delta_attention": _kda_core, "torch_chunk_gated_delta_rule": _gated_delta_core,
         "causal_conv1d_fn": _short_conv}


def _route(modeling) -> None:
    """Replace the modeling module's functions (those it has), once, by ones that take ours inside swapped layers
    only."""
    for name, ours in _OURS.items():
        stock = getattr(modeling, name, None)
        if stock is None or getattr(stock, "_moetune_stock", None) is not None:
            continue

        def routed(*args, _stock=stock, _ours=ours, **kwargs):
            inside = _swapped_layer.get() is not None
            return _ours(_stock, *args, **kwargs) if inside else _stock(*args, **kwargs)

        functools.update_wrapper(routed, stock)
        routed._moetune_stock = stock
        setattr(modeling, name, routed)


def _enter_swapped(module, args):
    _swapped_layer.set(module)


def _leave_swapped(module, args, output):
    _swapped_layer.set(None)


def _unbounded(layer) -> None:
    return None


def kda_swap(layer_class: str, gate_lower_bound: Callable[[torch.nn.Module], float | None] = _unbounded
             ) -> Callable[[torch.nn.Module], int]:
    """The swap for a family whose KDA (or Gated DeltaNet) layers are `layer_class` modules; `gate_lower_bound`
    reads from a layer the bound its gates keep (fla's faster path for bounded gates), if any."""

    def apply_kda_kernels(model: torch.nn.Module) -> int:
        """The layers' chunked core runs `kernels.kda` (fla on CUDA, the chunked PyTorch path on CPU), and their
        short conv keeps packed sequences apart. Single-token decoding keeps transformers' recurrent step.
        Returns the layers swapped.

        The layer is marked by hooks around its forward (they travel with deepcopy and gradient-checkpoint
        recompute; the closing one also runs when the forward raises)."""
        swapped = 0
        for module in model.modules():
            if type(module).__name__ != layer_class or getattr(module, "_moetune_kda", False):
                continue
            _route(sys.modules[type(module).__module__])
            module.register_forward_pre_hook(_enter_swapped)
            module.register_forward_hook(_leave_swapped, always_call=True)
            module._moetune_kda = True
            module._moetune_gate_lower_bound = gate_lower_bound(module)
            swapped += 1
        return swapped

    return apply_kda_kernels
