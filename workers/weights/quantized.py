"""Frozen quantized weights put into a streamed model: a `QuantizedLinear` in place of each quantized nn.Linear,
and quantized fused expert tensors held by their experts module until the expert-parallel module takes them."""

from __future__ import annotations

from torch import nn

from moetune.kernels.quant import QuantizedLinear, QuantizedWeight, hold


def install(model: nn.Module, param: str, qweight: QuantizedWeight, dense_dtype=None) -> None:
    """Puts `qweight` where parameter `param` of `model` was: a QuantizedLinear for a linear's weight, held by its
    module otherwise (fused experts); with `dense_dtype`, dequantized once into a frozen dense parameter instead."""
    module_name, _, attr = param.rpartition(".")
    module = model.get_submodule(module_name)
    if dense_dtype is not None:
        module._parameters[attr] = nn.Parameter(qweight.dequantize(dtype=dense_dtype), requires_grad=False)
    elif isinstance(module, nn.Linear) and attr == "weight":
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedLinear(qweight, module.bias))
    else:
        del module._parameters[attr]
        hold(module, attr, qweight)
