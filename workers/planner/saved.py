"""Bytes autograd saves for backward, counted the way the tuner's CPU measure counts them
(workers.loop.tuner.MemoryProbe: every storage once, parameters excluded), but keyed by the storage object rather
than its address, so it also counts tensors on the meta device (whose storages all sit at address 0). Each meta
storage counted is held until the counter goes: a saved tensor whose graph branch is dropped during the forward (a
router's scores, used only for its top-k indices) must not free a key that a later storage would then reuse. Real
storages are not held (the tuner counts during training, whose backward frees them as it goes) but watched through a
weak reference, which keeps a dead one's key from being taken by a new storage until the counter goes (without it
the allocator gave the key away at once: 50 saved vectors, each dropped before the next, counted as 6 to 8)."""

from __future__ import annotations

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef


class SavedBytes:
    """A running total of the storages packed for backward while `counting()` is active."""

    def __init__(self, model):
        self._excluded = {p.untyped_storage()._cdata for p in model.parameters()}
        self._seen: dict[int, object] = {}  # key -> the meta storage, or a real one's weak reference
        self.total = 0

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key not in self._excluded and key not in self._seen:
            self._seen[key] = storage if storage.device.type == "meta" else StorageWeakRef(storage)
            self.total += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def counting(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield self
