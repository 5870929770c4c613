"""The few collectives the loop itself runs (the model's own run inside DeepSpeed and the expert-parallel module):
small host values summed or maxed over every rank, through tensors on the communication device (NCCL has no CPU
tensors; gloo takes CPU tensors only; comm.checked checks it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moetune.workers.comm import checked


class Collectives:
    def __init__(self, device):
        self.device = device

    def barrier(self) -> None:
        checked.barrier()

    def all_sum(self, *values: float) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def all_max(self, *values: float) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MAX)

    def all_min(self, *values: float) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.MIN)

    def _all_reduce(self, values, op) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        checked.all_reduce(t, op=op)
        return t.tolist()
