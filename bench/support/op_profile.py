"""The benchmarks' `--profile N`: the N ops with the most self CPU time over a run's timed steps, per step."""

from __future__ import annotations


def print_top_ops(profiler, n_ops: int, steps: int, label: str) -> None:
    ops = sorted(profiler.key_averages(), key=lambda op: op.self_cpu_time_total, reverse=True)[:n_ops]
    print(f"{label}, per step: {'self ms':>8s} {'calls':>7s}  op", flush=True)
    for op in ops:
        print(f"{'':25s} {op.self_cpu_time_total / 1e3 / steps:8.2f} {op.count / steps:7.0f}  {op.key}", flush=True)
