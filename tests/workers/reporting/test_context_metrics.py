"""Context-parallel traffic in a worker's metrics: every CP exchange (comm.differentiable's all-gather and its
gradient's all-to-all) is counted with the bytes it sends to the other ranks, on two gloo ranks; WorkerMetrics
exports a step's count, and its MoE layers' all-to-all, as Prometheus counters (validation's exchanges too) and hands
the step figures the seconds of its training only."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from bench.support.harness import launch
from moetune.workers.comm.differentiable import CONTEXT_EXCHANGES
from moetune.workers.experts.module import ExpertParallelExperts


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
    model = _moe_model()
    first_moe = next(m for m in model.modules() if isinstance(m, ExpertParallelExperts))
    try:
        CONTEXT_EXCHANGES.sent_bytes += 1000  # an exchange before training: the planner's, not a step's
        metrics.training_started(model, context_parallel=True)
        labels = {"job_id": "ftjob-cp", "node": metrics.labels["node"], "rank": "1"}
        assert metrics.registry.get_sample_value("moetune_context_exchange_sent_bytes_total", labels) == 0
        exchanges = (CONTEXT_EXCHANGES, first_moe.comm)
        for stats in exchanges:  # the step's training: 32 bytes to rank 1
            with stats.timed(torch.zeros(2, 8), [1, 1], 0):
                pass
        metrics.training_part_done()
        for stats in exchanges:  # its validation: 16 bytes, longer than the training's: no figure may take it
            with stats.timed(torch.zeros(2, 4), [1, 1], 0):
                time.sleep(0.01)
        figures = metrics.step_end({}, 1.0, 1, 1)
        assert metrics.registry.get_sample_value("moetune_context_exchange_sent_bytes_total", labels) == 48
        seconds = metrics.registry.get_sample_value("moetune_context_exchange_seconds_total", labels)
        assert 0 < figures["context_seconds"] < 0.01 <= seconds  # the report's share is of training time
        layer = {**labels, "layer": metrics.moe.load.layers[0]}
        assert metrics.registry.get_sample_value("moetune_alltoall_sent_bytes_total", layer) == 48
        seconds = metrics.registry.get_sample_value("moetune_alltoall_seconds_total", layer)
        assert 0 < figures["alltoall_seconds"] < 0.01 <= seconds
    finally:
        metrics.close()


def _moe_model():
    """The tiny qwen3_moe with its experts in moetune's expert-parallel module (EP=1), as a job trains it."""
    from bench.support.tiny_models import plain_model
    from moetune.api.models.lora import LoraSpec
    from moetune.api.models.training import TrainingSpec
    from moetune.workers.experts.placement import placement_at
    from moetune.workers.families import REGISTRY
    from moetune.workers.model import trainable_model

    model = plain_model(REGISTRY["qwen3_moe"])
    return trainable_model(model, LoraSpec(rank=4, train_experts=True), TrainingSpec(),
                           placement_at(model.config.to_dict(), 1, 0))


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


def test_worker_metrics_export_a_pipeline_stage_s_traffic(monkeypatch):
    """A stage's rank exports its traffic as counters labelled with its stage, read at each scrape."""
    from moetune.workers.engine.pipeline import StageTraffic
    from moetune.workers.reporting.metrics import WorkerMetrics
    from moetune.workers.settings import WorkerSettings

    monkeypatch.setenv("MOETUNE_METRICS_PORT", "0")
    metrics = WorkerMetrics("ftjob-pp", 1, 1, torch.device("cpu"), lambda *a, **k: None, WorkerSettings())
    traffic = StageTraffic()
    try:
        metrics.training_started(_moe_model(), context_parallel=False, stage=(1, traffic))
        labels = {"job_id": "ftjob-pp", "node": metrics.labels["node"], "rank": "1", "stage": "1"}
        assert metrics.registry.get_sample_value("moetune_pipeline_sent_bytes_total", labels) == 0
        traffic.schedule_seconds, traffic.busy_seconds, traffic.sent_bytes, traffic.received_bytes = 2.0, 1.5, 64, 32
        for name, value in (("schedule_seconds", 2.0), ("busy_seconds", 1.5), ("sent_bytes", 64),
                            ("received_bytes", 32)):
            assert metrics.registry.get_sample_value(f"moetune_pipeline_{name}_total", labels) == value
    finally:
        metrics.close()
