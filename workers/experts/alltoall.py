"""Bytes and seconds of one MoE layer's token all-to-all exchanges (forward and backward).

On CUDA the collective only enqueues work, so host time would measure the launch: the exchange is timed
with CUDA events, resolved at step end (when the step has synchronised anyway). gloo's all-to-all is
synchronous, so host time is the exchange time.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager


class AllToAllStats:
    def __init__(self):
        self.sent_bytes = 0  # to other ranks only: the part of the exchange that crosses the network
        self.row_bytes = 0  # one token's bytes in the last exchange (a latent MoE's tokens travel at latent width)
        self.seconds = 0.0
        self._pending = []  # CUDA (start, end) event pairs not yet resolved

    @contextmanager
    def timed(self, x, in_splits: list[int], me: int):
        self.row_bytes = row_bytes = math.prod(x.shape[1:]) * x.element_size()  # also when x has no row
        self.sent_bytes += (sum(in_splits) - in_splits[me]) * row_bytes
        if x.is_cuda:
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((start, end))
        else:
            started = time.perf_counter()
            yield
            self.seconds += time.perf_counter() - started

    def drain(self) -> tuple[int, float]:
        """(bytes, seconds) since the last drain."""
        for start, end in self._pending:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        self._pending.clear()
        out = (self.sent_bytes, self.seconds)
        self.sent_bytes, self.seconds = 0, 0.0
        return out
