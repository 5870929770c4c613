"""How an nn.Module holds a frozen QuantizedWeight: its tensors as raw-byte (uint8) buffers, so `.to(device)` and
DeepSpeed move them and no module-wide dtype cast (DeepSpeed's bf16, `.half()`) can turn FP8 codes or fp32 scales
into something else (kernels/moe/linear.py's QuantizedLinear and the expert modules hold theirs so)."""

from __future__ import annotations

import torch
from torch import nn

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
