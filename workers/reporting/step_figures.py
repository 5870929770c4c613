"""The figures of one step that the adaptation report plots beyond its loss (they travel in the step's metrics
event and metrics.jsonl): the step's time split, the all-to-all and context-parallel shares of it, each rank's peak
memory against its budget, and each MoE layer's expert-load imbalance (max / mean load)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetune.workers.reporting.system import memory_bytes, peak_rss_bytes


def peak_memory_bytes(device) -> int:
    """Peak GPU memory held by tensors on CUDA; the process's peak resident memory elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_bytes()


def memory_budget_bytes(device, memory_budget_mb: float | None) -> int:
    """What one rank may use: the job's memory_budget_mb, else the GPU, else the node's memory limit."""
    if memory_budget_mb is not None:
        return int(memory_budget_mb * 1e6)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return memory_bytes()[0]


def step_figures(measured: dict, train_seconds: float, eval_seconds: float, rank: int, world: int, device,
                 all_sum: Callable[..., list[float]]) -> dict:
    """Every rank (one collective): `measured` is this rank's figures of the step (WorkerMetrics.step_end)."""
    mine = [0.0] * (3 * world)
    mine[rank], mine[world + rank] = peak_memory_bytes(device), measured.get("alltoall_seconds", 0.0)
    mine[2 * world + rank] = measured.get("context_seconds", 0.0)
    summed = all_sum(*mine)
    figures = {"train_seconds": train_seconds, "eval_seconds": eval_seconds,
               "alltoall_share": max(summed[world:2 * world]) / max(train_seconds, 1e-9),
               "memory_peak_mb": [b / 1e6 for b in summed[:world]]}
    if "context_seconds" in measured:  # every rank of a context-parallel job
        figures["context_share"] = max(summed[2 * world:]) / max(train_seconds, 1e-9)
    if "expert_imbalance" in measured:
        figures["expert_imbalance"] = measured["expert_imbalance"]
    return figures
