"""The optimizer settings Tinker's calls set per call, on an engine built once: the gradient clipping DeepSpeed
read from its config (the engine reads it per step; ZeRO-1/2's optimizer copied it at build), and Adam's moments
dropped for a load of weights without the optimizer."""

from __future__ import annotations


def set_gradient_clipping(engine, max_norm: float) -> None:
    """Clip the gradients' global norm to `max_norm` at the next step (0: no clipping)."""
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm


def forget_optimizer_state(engine) -> None:
    """A fresh Adam: its moments (and their step counts) start again at the next step."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    inner.state.clear()
