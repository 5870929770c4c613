"""Learning-rate schedule: the multiplier per step is api/lr_schedule.py's (the control plane warns from it)."""

from __future__ import annotations

from moetune.api.lr_schedule import lr_factor, total_steps

__all__ = ["lr_factor", "lr_scheduler", "total_steps"]


def lr_scheduler(optimizer, total: int, warmup_ratio: float, kind: str):
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup_ratio, kind))
