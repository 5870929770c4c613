"""Frozen quantized weights put into a streamed model: a `QuantizedLinear` in place of each quantized nn.Linear,
and quantized fused expert tensors held by their experts module until the expert-parallel module takes them.

A QuantizedWeight is always [..., out, in]; an experts module that says `is_transposed` (gpt-oss) stores its
dense tensors [E, in, out]."""

from __future__ import annotations

from torch import nn

from moetune.kernels.moe.linear import QuantizedLinear
from moetune.kernels.quant import QuantizedWeight, hold


def _transposed(model: nn.Module, param: str) -> bool:
    return getattr(model.get_submodule(param.rpartition(".")[0]), "is_transposed", False)


def quantized_shape(model: nn.Module, param: str, shape: tuple) -> tuple:
    """The [..., out, in] shape a quantized weight has for parameter `param` of allocated shape `shape`."""
    return (*shape[:-2], shape[-1], shape[-2]) if _transposed(model, param) else tuple(shape)


def install(model: nn.Module, param: str, qweight: QuantizedWeight, dense_dtype=None) -> None:
    """Puts `qweight` where parameter `param` of `model` was: a QuantizedLinear for a linear's weight, held by its
    module otherwise (fused experts); with `dense_dtype`, dequantized once into a frozen dense parameter instead."""
    module_name, _, attr = param.rpartition(".")
    module = model.get_submodule(module_name)
    if dense_dtype is not None:
        dense = qweight.dequantize(dtype=dense_dtype)
        dense = dense.transpose(-1, -2).contiguous() if _transposed(model, param) else dense
        module._parameters[attr] = nn.Parameter(dense, requires_grad=False)
    elif isinstance(module, nn.Linear) and attr == "weight":
        parent_name, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, QuantizedLinear(qweight, module.bias))
    else:
        del module._parameters[attr]
        hold(module, attr, qweight)
