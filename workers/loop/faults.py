"""Faults a test injects into a worker's step (a real OOM cannot be caused deterministically on CPU).

The step calls a `FaultHook` before each forward and backward; production runs pass `NO_FAULTS`. A test job sets
MOETUNE_INJECT_FAULTS (read once, by workers.settings) to one of:
  "<rank>:<step>"             that rank raises an OOM in the forward of the last micro-batch of that step, once;
  "<rank>:backward:<size>"    that rank raises an OOM in every backward of a micro-batch of <size> or more
                              (a memory limit the forward's prediction misses);
  "<rank>:forward:<size>"     the same in every forward (an OOM a rank cannot survive where the forward runs
                              collectives: expert parallelism, ZeRO-3).
"""

from __future__ import annotations

import torch


class FaultHook:
    """No faults."""

    def before_forward(self, step: int, last_micro_batch: bool, micro_batch_size: int) -> None:
        pass

    def before_backward(self, step: int, micro_batch_size: int) -> None:
        pass


NO_FAULTS = FaultHook()


class InjectedOOM(FaultHook):
    def __init__(self, rank: int, forward_step: int | None, backward_from: int | None,
                 forward_from: int | None = None):
        self.rank, self.forward_step, self.backward_from = rank, forward_step, backward_from
        self.forward_from = forward_from

    def before_forward(self, step: int, last_micro_batch: bool, micro_batch_size: int) -> None:
        if last_micro_batch and step == self.forward_step:
            self.forward_step = None
            raise torch.OutOfMemoryError(f"injected OOM on rank {self.rank} at step {step}")
        if self.forward_from and micro_batch_size >= self.forward_from:
            raise torch.OutOfMemoryError(f"injected OOM in a forward on rank {self.rank} at step {step}")

    def before_backward(self, step: int, micro_batch_size: int) -> None:
        if self.backward_from and micro_batch_size >= self.backward_from:
            raise torch.OutOfMemoryError(f"injected OOM in a backward on rank {self.rank} at step {step}")


def fault_hook(spec: str, rank: int) -> FaultHook:
    """The hook `spec` (see the module docstring) asks of `rank`; NO_FAULTS for other ranks and an empty spec."""
    target, _, what = spec.partition(":")
    if not target or int(target) != rank:
        return NO_FAULTS
    if what.startswith("backward:"):
        return InjectedOOM(rank, None, int(what.split(":")[1]))
    if what.startswith("forward:"):
        return InjectedOOM(rank, None, None, int(what.split(":")[1]))
    return InjectedOOM(rank, int(what), None)
