"""How many optimizer steps a job runs and its learning-rate multiplier per step (linear warmup, then cosine /
linear decay to zero, or constant). Torch-free: the workers' LR scheduler and the control plane's submission
warnings compute the same numbers."""

from __future__ import annotations

import math


def total_steps(n_examples: int, global_batch_size: int, max_steps: int | None, n_epochs: int | None) -> int:
    if max_steps is not None:
        return max_steps
    return math.ceil(n_examples / global_batch_size) * (n_epochs or 1)


def warmup_steps(total: int, warmup_ratio: float) -> int:
    return math.ceil(warmup_ratio * total)


def lr_factor(step: int, total: int, warmup_ratio: float, kind: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based) of `total`."""
    warmup = warmup_steps(total, warmup_ratio)
    if step < warmup:
        return (step + 1) / (warmup + 1)  # never exactly 0: the first step should move the weights
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
