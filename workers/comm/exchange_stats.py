"""Bytes and seconds of a series of exchanges, forward and backward: one MoE layer's token all-to-alls, a rank's
context-parallel gathers.

On CUDA the collective only enqueues work, so host time would measure the launch: the exchange is timed with CUDA
events. Each exchange folds the pairs that have completed into the seconds (`query` does not wait), and at most
MAX_PENDING pairs stay unresolved: a session never ends a step (WorkerMetrics.step_end drains), so without the fold
its events would pile up by hundreds per call for as long as it lives. gloo's collectives are synchronous: host
"events" time them, complete once recorded, through the same accounting.
"""

from __future__ import annotations

import collections
import math
import time
from contextlib import contextmanager

MAX_PENDING = 64  # unresolved event pairs per layer; beyond, the oldest is waited for (the GPU is that far behind)


class HostEvent:
    """A CUDA timing event's counterpart for a synchronous exchange: the host clock at `record`."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as torch.cuda.Event's


def timing_events(x) -> tuple:
    """A (start, end) pair that times work on x's device."""
    if x.is_cuda:
        import torch

        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    return HostEvent(), HostEvent()


class ExchangeStats:
    def __init__(self, events=timing_events):
        self.sent_bytes = 0  # to other ranks only: the part of the exchange that crosses the network
        self.row_bytes = 0  # one token's bytes in the last exchange (a latent MoE's tokens travel at latent width)
        self.seconds = 0.0
        self._events = events
        self._pending = collections.deque()  # (start, end) event pairs not yet folded into seconds, oldest first

    @contextmanager
    def timed(self, x, in_splits: list[int], me: int):
        """Times the exchange inside, which sends in_splits[r] of x's rows to rank r (me: this rank)."""
        self.row_bytes = row_bytes = math.prod(x.shape[1:]) * x.element_size()  # also when x has no row
        self.sent_bytes += (sum(in_splits) - in_splits[me]) * row_bytes
        start, end = self._events(x)
        start.record()
        yield
        end.record()
        self._pending.append((start, end))
        self._fold(everything=False)

    def _fold(self, everything: bool) -> None:
        """Adds the time of the completed pairs (in order: a stream completes its events in order), of every pair
        when `everything`, and of the oldest beyond MAX_PENDING."""
        while self._pending and (everything or len(self._pending) > MAX_PENDING or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000

    def drain(self) -> tuple[int, float]:
        """(bytes, seconds) since the last drain."""
        self._fold(everything=True)
        out = (self.sent_bytes, self.seconds)
        self.sent_bytes, self.seconds = 0, 0.0
        return out
