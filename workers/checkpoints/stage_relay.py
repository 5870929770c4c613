"""The adapter of a pipelined job is one file, but each pipeline stage holds its own layers' LoRA: each stage's
first rank writes its share through a `StageRelay` (the adapter writer's `write`, sent to it), and the writer, on
world rank 0, takes every other stage's pieces after its own, stage by stage (`receive_stages`). A piece is a
header object (tensor name, element offset, shape, dtype), then its tensor on the communication device; a `None`
header ends a stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moetune.workers.comm.checked import comm_device_type


@dataclass(frozen=True)
class PipelinedModel:
    """What a pipeline stage's rank saves from: the whole PEFT model (the other stages' tensors on the meta
    device), its stage, and each stage's first world rank (ParallelDims.stage_first_ranks)."""

    model: nn.Module
    stage: int
    first_ranks: tuple[int, ...]

    @property
    def stage_writer(self) -> bool:
        """Whether this rank writes its stage's share."""
        return dist.get_rank() == self.first_ranks[self.stage]


class StageRelay:
    """Sends what a stage's writer would write to the adapter's writer on `dst`."""

    def __init__(self, dst: int):
        self.dst, self.device = dst, comm_device_type()

    def write(self, name: str, element_offset: int, values: torch.Tensor) -> None:
        dist.send_object_list([(name, element_offset, tuple(values.shape), values.dtype)], dst=self.dst,
                              device=self.device)
        dist.send(values.detach().to(self.device).contiguous(), dst=self.dst)

    def close(self) -> None:
        dist.send_object_list([None], dst=self.dst, device=self.device)


def receive_stages(writer, sources: tuple[int, ...]) -> None:
    """Writes every piece the stage writers `sources` relay, one stage after the other, into `writer`."""
    device = comm_device_type()
    for src in sources:
        while True:
            header = [None]
            dist.recv_object_list(header, src=src, device=device)
            if header[0] is None:
                break
            name, offset, shape, dtype = header[0]
            values = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(values, src=src)
            writer.write(name, offset, values)
