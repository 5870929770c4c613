"""A CPU stand-in for "the model is on a GPU": tensors that moetune's own code makes without naming a device land
on the meta device instead of the host.

On a GPU such a tensor lands on the host, next to weights on the device: a buffer that stays there (DeepSpeed never
moves a model whose weights ZeRO-3 partitioned at load), a device-to-host copy per layer, or "Expected all tensors
to be on the same device". On CPU the host *is* the device, so nothing shows. Under `implicit_device_elsewhere()` such
a tensor is a meta tensor: an op mixing it with real ones raises, and `meta_tensors` finds any left in a model.

What it sees: every factory call (torch.empty, zeros, tensor, arange, ...) whose nearest caller outside torch is a
moetune module, in whatever runs inside (build, engine, step, metrics). What it cannot see: library code's own
defaults (transformers, PEFT, DeepSpeed: their GPU paths are theirs), tensors moved to the host on purpose
(`.cpu()`, `device="cpu"`), and host syncs.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.overrides import TorchFunctionMode

_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.rand, torch.randn,
              torch.randint, torch.randperm, torch.eye, torch.linspace, torch.empty_strided}


def _called_from_moetune() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module != __name__ and not module.startswith("torch"):
            return module.startswith("moetune.")
        frame = frame.f_back
    return False


class _ImplicitDeviceElsewhere(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and _called_from_moetune():
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def implicit_device_elsewhere():
    with _ImplicitDeviceElsewhere():
        yield


def meta_tensors(*modules, **named_tensors) -> list[str]:
    """Names of the meta tensors among the modules' parameters (and their ZeRO-3 partitions), buffers and
    quantized weights held as buffers, and the named tensors."""
    found = [name for name, t in named_tensors.items() if t.device.type == "meta"]
    for module in modules:
        for name, p in module.named_parameters():
            found += [name for t in (p, getattr(p, "ds_tensor", p)) if t.device.type == "meta"]
        found += [name for name, b in module.named_buffers() if b is not None and b.device.type == "meta"]
    return sorted(set(found))
