"""What a planned forward computes and exchanges besides what it saves: the floating-point operations of its
attention kernels (softmax attention, KDA) and the bytes its context-parallel all-gathers receive. The kernels'
meta-device stand-ins (planner.device_ops) and the CP collectives' (planner.context) report them to the `Work`
that is counting; the linear layers' operations the planner takes from the weights themselves (planner.timing)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

_COUNTING: ContextVar[Work | None] = ContextVar("planner_work", default=None)


@dataclass
class Work:
    flops: float = 0.0  # attention kernels' forward operations
    received: float = 0.0  # bytes the CP all-gathers bring in (the forward's)

    @contextlib.contextmanager
    def counting(self) -> Iterator[Work]:
        token = _COUNTING.set(self)
        try:
            yield self
        finally:
            _COUNTING.reset(token)


def add(flops: float = 0.0, received: float = 0.0) -> None:
    if (work := _COUNTING.get()) is not None:
        work.flops += flops
        work.received += received


def attention_flops(batch_heads: int, queries: int, keys: int, width: int, causal: bool) -> float:
    """Softmax attention's forward: q·kᵀ and p·v over the (query, key) pairs it computes; `width`: a query's and a
    value's widths together. Causal queries are the last `queries` of the `keys` (a CP rank's over the whole row):
    each sees the keys up to itself."""
    pairs = queries * (keys - queries) + queries * (queries + 1) / 2 if causal else queries * keys
    return 2.0 * batch_heads * pairs * width


def kda_flops(tokens_heads: int, key_width: int, value_width: int, chunk: int) -> float:
    """KDA's forward in fla's chunk form, per token and head: the state's read, its correction and its update
    (three [K, V] products) and the intra-chunk matrices and their products ([chunk, K] and [chunk, V], two each)."""
    return 2.0 * tokens_heads * (3 * key_width * value_width + 2 * chunk * (key_width + value_width))
