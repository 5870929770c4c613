"""The KDA kernel swap, shared by the families with Kimi Delta Attention layers (kimi_linear, glm5_next): their
chunked core runs `kernels.kda` instead of transformers' `chunk_kimi_delta_attention`, without editing transformers.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable

import torch

from moetune.kernels.kda import chunk_kda

# The KDA layer's core is transformers' `chunk_kimi_delta_attention`, a module-level function of the layer's
# modeling module, looked up at call time.
_CORE = "chunk_kimi_delta_attention"
_in_swapped_layer = contextvars.ContextVar("moetune_kda_swapped", default=False)


def _kda_core(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' chunk_kimi_delta_attention contract, computed by `kernels.kda.chunk_kda`."""
    return chunk_kda(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=kwargs.get("cu_seqlens"))


def _route_core(modeling) -> None:
    """Replace the modeling module's core function, once, by one that takes our kernel inside swapped layers only."""
    stock = getattr(modeling, _CORE)
    if getattr(stock, "_moetune_stock", None) is not None:
        return

    @functools.wraps(stock)
    def routed(*args, **kwargs):
        return (_kda_core if _in_swapped_layer.get() else stock)(*args, **kwargs)

    routed._moetune_stock = stock
    setattr(modeling, _CORE, routed)


def _enter_swapped(module, args):
    _in_swapped_layer.set(True)


def _leave_swapped(module, args, output):
    _in_swapped_layer.set(False)


def kda_swap(layer_class: str) -> Callable[[torch.nn.Module], int]:
    """The swap for a family whose KDA layers are `layer_class` modules."""

    def apply_kda_kernels(model: torch.nn.Module) -> int:
        """The KDA layers' chunked core runs `kernels.kda` (Triton on CUDA, the chunked PyTorch path on CPU).
        Single-token decoding keeps transformers' recurrent step. Returns the layers swapped.

        The layer is marked by hooks around its forward (they travel with deepcopy and gradient-checkpoint
        recompute; the closing one also runs when the forward raises)."""
        swapped = 0
        for module in model.modules():
            if type(module).__name__ != layer_class or getattr(module, "_moetune_kda", False):
                continue
            _route_core(sys.modules[type(module).__module__])
            module.register_forward_pre_hook(_enter_swapped)
            module.register_forward_hook(_leave_swapped, always_call=True)
            module._moetune_kda = True
            swapped += 1
        return swapped

    return apply_kda_kernels
