"""A recorder of what ops allocate while it is active: the largest new tensor (elements, and bytes of its storage)
and the number of matmuls. A view or alias of an op's input is not an allocation."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


class Allocations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0  # elements of the largest tensor an op returned in new storage
        self.largest_bytes = 0  # bytes of the largest new storage (a view's base counts whole)
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.matmuls += func in _MATMULS
        inputs = {a.untyped_storage().data_ptr() for a in (*args, *(kwargs or {}).values())
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
                self.largest_bytes = max(self.largest_bytes, t.untyped_storage().nbytes())
        return out
