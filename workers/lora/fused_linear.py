"""PEFT's LoRA linear with its update added inside one GEMM: y = x Wᵀ + s · (x Aᵀ) Bᵀ as addmm(x Wᵀ, x Aᵀ, Bᵀ,
alpha=s), where PEFT runs B's GEMM, then a multiply by s and an add over the whole [tokens, out] output, and the
backward of each. The same tensors are saved for the backward (x, x Aᵀ, and the weights).

Measured on bench/images.py (32 image rows a rank, ~31 LoRA linears a rank, two alternating engines in the same
processes over 40 rounds): 115.4 -> 112.3 and 111.3 -> 108.9 ms a step. Also fusing the LoRA A of
linears that read the same input (four input projections, q/k/v, gate/up) added nothing more.

Whatever the fused path does not cover (several or disabled adapters, merged weights, variants such as DoRA,
PEFT's per-row `adapter_names`, a LoRA bias, mixed dtypes, factors ZeRO-3 partitions outside their module's
forward) runs PEFT's own forward.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import Linear


class FusedLoraLinear(Linear):
    """A PEFT lora.Linear whose plain single-adapter forward is one addmm (`fuse_lora_linears` turns them)."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = None if args or kwargs else self._fusable_adapter(x)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        # module calls, as PEFT makes them: ZeRO-3 gathers the base weight and A in their forward hooks
        result = self.base_layer(x)
        low_rank = self.lora_A[adapter](self.lora_dropout[adapter](x))
        fused = torch.addmm(result.reshape(-1, result.shape[-1]), low_rank.reshape(-1, low_rank.shape[-1]),
                            self.lora_B[adapter].weight.t(), alpha=self.scaling[adapter])
        return fused.view(result.shape)

    def _fusable_adapter(self, x: torch.Tensor) -> str | None:
        """The one active plain-LoRA adapter whose update the fused path computes exactly, else None."""
        if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
            return None
        adapter = self.active_adapters[0]
        if adapter not in self.lora_A or adapter in self.lora_variant:
            return None
        b = self.lora_B[adapter]
        # a ZeRO-3 partitioned B (DeepSpeed tags it ds_id) is whole only inside its own module's forward; an
        # nn.Linear base (dense, or kernels.moe's QuantizedLinear) answers in its input's dtype
        if b.bias is not None or hasattr(b.weight, "ds_id") or not isinstance(self.get_base_layer(), torch.nn.Linear):
            return None
        return adapter if x.dtype == self.lora_A[adapter].weight.dtype == b.weight.dtype else None


def fuse_lora_linears(model) -> int:
    """Turns every PEFT lora.Linear of `model` into a FusedLoraLinear (same state, same parameters); how many."""
    turned = 0
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = FusedLoraLinear
            turned += 1
    return turned
