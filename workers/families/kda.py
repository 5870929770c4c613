"""Put our kernels (kernels/) into a loaded transformers model, per family, without editing transformers.

`apply_kernel_swaps(model)` runs the swaps registered for the model's `model_type` and returns how many modules
each one changed. A swap changes behaviour only of the module instances it is given: other models in the same
process keep the stock code path, which is also how "kernels off" is expressed (do not call it).
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable

import torch

from moetune.kernels.kda import chunk_kda
from moetune.workers.families.glm5_next.sparse_attention import apply_sparse_attention_kernels

# Linear-attention layers whose core is transformers' `chunk_kimi_delta_attention` (a module-level function of
# the layer's modeling module, looked up at call time).
KDA_LAYERS = ("KimiLinearDeltaAttention", "Glm5NextTextLinearAttention")
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


def apply_kda_kernels(model: torch.nn.Module) -> int:
    """KDA layers of kimi_linear and glm5_next: their chunked core runs `kernels.kda` (Triton on CUDA, the chunked
    PyTorch path on CPU). Single-token decoding keeps transformers' recurrent step. Returns the layers swapped.

    The layer is marked by hooks around its forward (they travel with deepcopy and gradient-checkpoint recompute;
    the closing one also runs when the forward raises)."""
    swapped = 0
    for module in model.modules():
        if type(module).__name__ not in KDA_LAYERS or getattr(module, "_moetune_kda", False):
            continue
        _route_core(sys.modules[type(module).__module__])
        module.register_forward_pre_hook(_enter_swapped)
        module.register_forward_hook(_leave_swapped, always_call=True)
        module._moetune_kda = True
        swapped += 1
    return swapped


# model_type -> swaps, in the order they are applied.
FAMILY_SWAPS: dict[str, tuple[Callable[[torch.nn.Module], int], ...]] = {
    "kimi_linear": (apply_kda_kernels,),
    "glm5_next": (apply_kda_kernels, apply_sparse_attention_kernels),
    "glm5_next_text": (apply_kda_kernels, apply_sparse_attention_kernels),
}


def apply_kernel_swaps(model: torch.nn.Module) -> dict[str, int]:
    """Apply every swap registered for the model's family; {swap name: modules changed}."""
    swaps = FAMILY_SWAPS.get(model.config.model_type, ())
    return {swap.__name__: swap(model) for swap in swaps}
