"""Collectives inside the autograd graph (context parallelism's: kda_context, conv_halo, mla_context), through
`checked`.

A collective's backward is itself a collective, which every rank of the group must reach: a rank whose loss does
not depend on what it gathered (CP rank 0 reads no earlier rank's state) still has to run it, so the callers keep
the gathered tensor in their graph with `entangled`."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from moetune.workers.comm import checked
from moetune.workers.comm.exchange_stats import ExchangeStats

# This process's context-parallel exchanges (every CP path gathers through _AllGather), drained once a step by
# workers.reporting.metrics into the job's Prometheus series and step figures.
CONTEXT_EXCHANGES = ExchangeStats()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        x = x.contiguous()
        with _recorded(x[None].expand(len(out), *x.shape), dist.get_rank(group)):  # x itself to every other rank
            checked.all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, d_out):
        # a reduce-scatter: rank i's gradient for part j goes to rank j, which sums what it receives (as an
        # all-to-all and a sum, one code path on gloo, which has no reduce-scatter, and NCCL)
        received = torch.empty_like(d_out, memory_format=torch.contiguous_format)
        d_out = d_out.contiguous()
        with _recorded(d_out, dist.get_rank(ctx.group)):  # part j to rank j
            checked.all_to_all_single(received, d_out, group=ctx.group)
        return received.sum(0), None


def _recorded(parts: torch.Tensor, me: int):
    """Times an exchange that sends parts[r] to rank r, into CONTEXT_EXCHANGES; the planner's meta forwards (in a
    worker too, for the tuner's start) move nothing and are not counted."""
    return contextlib.nullcontext() if parts.is_meta else CONTEXT_EXCHANGES.timed(parts, [1] * len(parts), me)


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """(world, *x.shape): every rank's `x` in rank order; the backward hands each rank the sum of every rank's
    gradient for its part."""
    return _AllGather.apply(x, group)


class _Entangled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, other):
        ctx.other = (other.shape, other.dtype, other.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, d_x):
        shape, dtype, device = ctx.other
        return d_x, torch.zeros(shape, dtype=dtype, device=device)


def entangled(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`x` itself, with `other` in its graph (a zero gradient): the backward reaching `x` reaches `other`'s
    collective too."""
    return _Entangled.apply(x, other)
