"""How an nn.Module holds a frozen QuantizedWeight: its tensors as raw-byte (uint8) buffers, so `.to(device)` and
DeepSpeed move them and no module-wide dtype cast (DeepSpeed's bf16, `.half()`) can turn FP8 codes or fp32 scales
into something else; and `QuantizedLinear`, the frozen nn.Linear built on it."""

from __future__ import annotations

import torch
from torch import nn

from moetune.kernels.quant.linear import quantized_linear
from moetune.kernels.quant.weight import QuantizedWeight

_HELD = "_moetune_quantized"  # module attribute: {name: (template QuantizedWeight, {tensor: dtype})}


def hold(module: nn.Module, name: str, qweight: QuantizedWeight) -> None:
    """Registers `qweight`'s tensors on `module` as byte buffers `<name>_q_<tensor>`; `held` rebuilds it."""
    dtypes = {}
    for tensor_name, t in qweight.tensors().items():
        module.register_buffer(f"{name}_q_{tensor_name}", t.contiguous().view(torch.uint8), persistent=False)
        dtypes[tensor_name] = t.dtype
    module.__dict__.setdefault(_HELD, {})[name] = (qweight, dtypes)


def held(module: nn.Module, name: str) -> QuantizedWeight:
    template, dtypes = module.__dict__[_HELD][name]
    return template.with_tensors(**{t: getattr(module, f"{name}_q_{t}").view(dtype) for t, dtype in dtypes.items()})


def held_names(module: nn.Module) -> list[str]:
    return list(module.__dict__.get(_HELD, {}))


class QuantizedLinear(nn.Linear):
    """A frozen nn.Linear whose weight stays quantized: y = x Wᵀ + b with W dequantized a tile of rows at a time
    (kernels.quant.quantized_linear). PEFT wraps it like any nn.Linear; its LoRA stays in full precision."""

    def __init__(self, qweight: QuantizedWeight, bias: nn.Parameter | None):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a dense weight
        self.out_features, self.in_features = qweight.shape
        self.register_parameter("weight", None)
        self.bias = bias
        hold(self, "weight", qweight)

    @property
    def qweight(self) -> torch.Tensor:
        """The stored codes, as bytes: where PEFT (like for GPTQ layers) reads a quantized layer's device, and why
        it leaves the LoRA dtype alone (not a floating tensor)."""
        return next(getattr(self, f"weight_q_{name}") for name in self.__dict__[_HELD]["weight"][1])

    def forward(self, x):
        y = quantized_linear(x, held(self, "weight"))
        return y if self.bias is None else y + self.bias
