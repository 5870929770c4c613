"""Context parallelism inside a family's forward: within `context_parallel(model, layout, group)` the model runs
this rank's contiguous slice of each row (its tokens, global positions and own packed offsets, cut by
workers.methods.context_cut), and the layers that mix tokens reach the rest of the row through the CP group:
- KDA (the KDA swap's layers; Gated DeltaNet's refuse for now): the recurrent state carried across the ranks
  (workers/comm/kda_context) and the short convs' `width − 1` halo (workers/comm/conv_halo);
- softmax attention whose keys go through its `cache` argument, as Kimi K3's MLA passes its compressed latent (the
  modules a swap marked with `GATHERS_KEYS`): the whole row's keys gathered (workers/comm/mla_context); the segment
  swap's modules attend each query over its sequence's keys up to itself, GLM-5-Next's DSA (the sparse swap) over
  the row's keys its indexer selects, the indexer's own keys gathered too.
Everything else (embeddings, norms, Attention Residuals, routers, experts, the loss head) is per token and runs on
the slice unchanged. Each rank's parameter gradients are its part: the CP group sums them.

The slice is kept on the layers themselves, not in a context variable, because the backward may run on another
thread and recomputes checkpointed layers there: the forward and the backward both run inside the context. A
packed row's slice goes in with its own offsets (`layout.local_offsets` as `cu_seq_lens_q`), as the swaps read
them."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moetune.kernels.kda.context_slices import SliceLayout
from moetune.workers.comm.mla_context import GatheredKeys

_SLICE = "_moetune_context_slice"  # the attribute the layers of a CP forward carry
GATHERS_KEYS = "_moetune_gathers_keys"  # a swapped attention module that takes the whole row's keys as its cache


@dataclass(frozen=True)
class ContextSlice:
    layout: SliceLayout
    group: object = None  # the CP process group (None: the default group)


def context_slice(module: torch.nn.Module) -> ContextSlice | None:
    """The slice a layer runs in a CP forward, None outside one."""
    return getattr(module, _SLICE, None)


@contextmanager
def context_parallel(model: torch.nn.Module, layout: SliceLayout, group=None) -> Iterator[None]:
    """Runs `model`'s forward and backward inside on this rank's slice (`layout`) of its rows. Raises before
    anything changes when a layer that mixes tokens has no CP path."""
    kda = [m for m in model.modules() if getattr(m, "_moetune_kda", False)]
    attention = [m for m in model.modules() if getattr(m, GATHERS_KEYS, False)]
    if not kda and not attention:
        raise ValueError("context parallelism needs the family's kernel swaps applied (custom kernels on)")
    for module in attention:
        if "cache" not in inspect.signature(module.forward).parameters:
            raise ValueError(f"{type(module).__name__} passes its keys through no `cache` argument: it has no "
                             "context-parallel path")
    part = ContextSlice(layout, group)
    hooks = [m.register_forward_pre_hook(_gather_keys, with_kwargs=True) for m in attention]
    for module in (*kda, *attention):
        setattr(module, _SLICE, part)
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module in (*kda, *attention):
            delattr(module, _SLICE)


def min_slice_tokens(model: torch.nn.Module) -> int:
    """The fewest tokens a CP slice may hold: the widest short conv's halo (`width − 1`) of the swapped KDA
    layers, which only the previous rank's slice supplies."""
    widths = [conv.kernel_size[0] for m in model.modules() if getattr(m, "_moetune_kda", False)
              for conv in m.modules() if isinstance(conv, torch.nn.Conv1d)]
    return max([1, *(w - 1 for w in widths)])


def _gather_keys(module, args, kwargs):
    part = context_slice(module)
    return args, {**kwargs, "cache": GatheredKeys(part.layout, part.group)}
