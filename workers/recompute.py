"""Activation checkpointing per decoder layer (`training.activation_checkpointing`), and whether the forward that
runs now is a checkpoint's recompute.

Each decoder layer (transformers' `GradientCheckpointingLayer`, every family's) keeps only its inputs; the backward
reruns its forward through non-reentrant `torch.utils.checkpoint`, the expert-parallel all-to-all included. Every
rank runs the backward of the same graph in the same order, so the rerun exchanges pair up across ranks as the
forward's did, and the RNG state (LoRA dropout) is restored for the rerun. Hooks that count what a forward did
(expert load) skip reruns by asking `recomputing()`; the rerun's token exchanges are real traffic and are counted.
"""

from __future__ import annotations

import contextlib

_reruns = 0  # a process-wide count, not thread-local: CUDA backwards run in autograd's device threads


@contextlib.contextmanager
def _rerun():
    global _reruns
    _reruns += 1
    try:
        yield
    finally:
        _reruns -= 1


def recomputing() -> bool:
    """True inside a checkpointed layer's rerun in the backward."""
    return _reruns > 0


def _contexts():
    return contextlib.nullcontext(), _rerun()


def decoder_layers(model) -> list:
    """The layers checkpointing reruns: every family's decoder layers are transformers' GradientCheckpointingLayer."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_activation_checkpointing(model) -> int:
    """Checkpoints every decoder layer of a transformers model (PEFT-wrapped too); returns how many."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False, context_fn=_contexts)
    return len(layers)
