"""The forward a context-parallel rank runs, on the meta device in one process: what the planner measures for a
job split over `size` CP ranks (planner.activations).

It is the job's own CP forward (workers.families.context) for the last rank of the group, the one whose queries
attend over the whole row's gathered keys: the KDA state summaries and the conv halo exchanged, the MLA keys
gathered. No process group exists here, so the CP collectives (all through workers.comm.differentiable's
all-gather) are given the group's size and this rank's index and leave their meta outputs as they are: a meta
tensor has shapes only, so every tensor the real forward saves is counted at its real size."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from unittest import mock

import torch

from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.comm import checked, differentiable, kda_context
from moetune.workers.families.context import context_parallel
from moetune.workers.planner import work


@contextmanager
def last_context_rank(model: torch.nn.Module, slice_tokens: int, size: int) -> Iterator[SliceLayout]:
    """Inside, `model`'s forward over `slice_tokens` tokens per row runs as rank size − 1 of `size` CP ranks;
    yields that rank's slice layout."""
    layout = SliceLayout.even(slice_tokens * size, size, size - 1)
    its_group = SimpleNamespace(get_world_size=lambda group=None: size, get_rank=lambda group=None: size - 1)
    with ExitStack() as stack:
        for module in (differentiable, kda_context):  # what they ask torch.distributed
            stack.enter_context(mock.patch.object(module, "dist", its_group))
        stack.enter_context(mock.patch.object(checked, "all_gather", _leave_as_is))
        stack.enter_context(context_parallel(model, layout))
        yield layout


def _leave_as_is(out: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    if out.device.type != "meta":
        raise RuntimeError("the planner's CP forward runs on the meta device only")
    work.add(received=out.nbytes - tensor.nbytes)
