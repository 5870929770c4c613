"""Context-parallel traffic in a worker's metrics: every CP exchange (comm.differentiable's all-gather and its
gradient's all-to-all) is counted with the bytes it sends to the other ranks, on two gloo ranks; WorkerMetrics
exports a step's count as Prometheus counters (validation's exchanges too) and hands the step figures the seconds of
its training."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from bench.support.harness import launch
from moetune.workers.comm.differentiable import CONTEXT_EXCHANGES


def _gather_twice(rank: int, world: int, out_dir: str) -> None:
    from moetune.workers.comm import checked
    from moetune.workers.comm.differentiable import all_gather

    CONTEXT_EXCHANGES.drain()
    x = torch.randn(3, 5, requires_grad=True)  # 60 bytes
    all_gather(x).sum().backward()
    # a planner's meta forward (workers.planner.context leaves the gathered meta output as it is) moves nothing
    checked.all_gather = lambda out, x, group=None: None
    all_gather(torch.randn(4, device="meta"))
    torch.save(CONTEXT_EXCHANGES.drain(), os.path.join(out_dir, f"rank{rank}.pt"))


def test_each_exchange_counts_what_it_sends_to_the_other_ranks(tmp_path):
    launch(_gather_twice, 2, str(tmp_path))
    for rank in range(2):
        sent, seconds = torch.load(tmp_path / f"rank{rank}.pt")
        assert sent == 2 * 60 and seconds > 0  # its slice forward, the other rank's gradient part backward


def test_worker_metrics_export_a_steps_exchanges(monkeypatch):
    from moetune.workers.reporting.metrics import WorkerMetrics
    from moetune.workers.settings import WorkerSettings

    monkeypatch.setenv("MOETUNE_METRICS_PORT", "0")
    metrics = WorkerMetrics("ftjob-cp", 1, 1, torch.device("cpu"), lambda *a, **k: None, WorkerSettings())
    try:
        CONTEXT_EXCHANGES.sent_bytes += 1000  # an exchange before training: the planner's, not a step's
        metrics.training_started(torch.nn.Linear(2, 2), context_parallel=True)
        labels = {"job_id": "ftjob-cp", "node": metrics.labels["node"], "rank": "1"}
        assert metrics.registry.get_sample_value("moetune_context_exchange_sent_bytes_total", labels) == 0
        with CONTEXT_EXCHANGES.timed(torch.zeros(2, 8), [1, 1], 0):  # the step's training: 32 bytes to rank 1
            pass
        metrics.training_part_done()
        with CONTEXT_EXCHANGES.timed(torch.zeros(2, 4), [1, 1], 0):  # its validation: 16 bytes
            time.sleep(0.01)  # longer than the training's exchange: the figure must not take it
        figures = metrics.step_end({}, 1.0, 1, 1)
        assert metrics.registry.get_sample_value("moetune_context_exchange_sent_bytes_total", labels) == 48
        seconds = metrics.registry.get_sample_value("moetune_context_exchange_seconds_total", labels)
        assert 0 < figures["context_seconds"] < 0.01 <= seconds  # the report's share is of training time
    finally:
        metrics.close()


@pytest.mark.parametrize("context", [True, False])
def test_the_step_figures_carry_the_slowest_ranks_share_only_for_a_cp_job(context):
    from moetune.workers.reporting.step_figures import step_figures

    mine = {"alltoall_seconds": 0.1, **({"context_seconds": 0.25} if context else {})}
    others = [0.0, 2e6, 0.0, 0.3, 0.0, 0.5 if context else 0.0]  # rank 1's memory, all-to-all and CP seconds

    def all_sum(*values):
        return [a + b for a, b in zip(values, others)]

    figures = step_figures(mine, 1.0, 0.0, 0, 2, SimpleNamespace(type="cpu"), all_sum)
    assert figures["alltoall_share"] == pytest.approx(0.3)
    assert figures.get("context_share") == (pytest.approx(0.5) if context else None)
