"""Per-worker Prometheus metrics: node resources, all-to-all and context-parallel traffic, expert load and training
progress.

Every series carries job_id, node and rank labels ("job" would clash with the scrape job label Prometheus
adds itself). Node series (network, memory) come from the node's first worker only; global numbers
(loss, learning rate, tokens, expert load) from rank 0 only; per-rank numbers from every worker.
"""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from moetune.workers.comm.differentiable import CONTEXT_EXCHANGES
from moetune.workers.reporting.exporter import Exporter
from moetune.workers.reporting.moe import MoEMetrics
from moetune.workers.reporting.system import NodeCollector, ProcessCollector
from moetune.workers.settings import WorkerSettings

PHASES = ("loading", "training")
# a pipeline stage's rank: its counters (workers.engine.pipeline.StageTraffic's fields); the bubble is
# 1 - rate(busy) / rate(schedule)
STAGE_COUNTERS = (("schedule_seconds", "moetune_pipeline_schedule_seconds", "Time in the stage's pipeline schedules"),
                  ("busy_seconds", "moetune_pipeline_busy_seconds",
                   "Time of it in the stage's forwards, backwards and loss (the rest: sends, receives, the bubble)"),
                  ("sent_bytes", "moetune_pipeline_sent_bytes", "Activations and gradients the stage sent"),
                  ("received_bytes", "moetune_pipeline_received_bytes",
                   "Activations and gradients the stage received"))


class StageCollector(Collector):
    """A pipeline stage's rank's STAGE_COUNTERS, read from its traffic at each scrape."""

    def __init__(self, labels: dict[str, str], stage: int, traffic):
        self.names, self.values, self.traffic = [*labels, "stage"], [*labels.values(), str(stage)], traffic

    def collect(self):
        for field, name, doc in STAGE_COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=self.names)
            counter.add_metric(self.values, getattr(self.traffic, field))
            yield counter


def _node_address() -> str:
    import ray.util

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside a Ray worker
        return socket.gethostname()


class WorkerMetrics:
    def __init__(self, job_id: str, rank: int, local_rank: int, device, event, settings: WorkerSettings):
        """Starts serving at once (phase "loading"); `event(message, level=...)` reports exporter problems."""
        self.chief = rank == 0
        node, address = socket.gethostname(), _node_address()
        self.labels = {"job_id": job_id, "node": node, "rank": str(rank)}
        disable_created_metrics()  # no `_created` twin of every counter: half the series, nothing lost
        self.registry = CollectorRegistry()
        self.registry.register(ProcessCollector(self.labels, device))
        if local_rank == 0:
            # the node's address too: where its NICs' bytes go (hostnames may repeat across clusters)
            self.registry.register(NodeCollector({"job_id": job_id, "node": node, "address": address}))
        self.phase = self._gauge("moetune_worker_phase", "1 for the phase the worker is in", "phase")
        self.step_seconds = self._gauge("moetune_train_step_seconds",
                                        "Wall time of the last step, with its evaluation if it had one")
        self.micro_batch = self._gauge("moetune_train_micro_batch_size", "Sequences per micro-batch on this rank")
        self.grad_accum = self._gauge("moetune_train_grad_accum_steps", "Micro-batches per optimizer step")
        if self.chief:
            self.step = self._gauge("moetune_train_step", "Last finished optimizer step")
            self.total_steps = self._gauge("moetune_train_total_steps", "Optimizer steps the job will run")
            self.loss = self._gauge("moetune_train_loss", "Training loss of the last step (mean over ranks)")
            self.valid_loss = self._gauge("moetune_train_valid_loss", "Validation loss of the last evaluation")
            self.learning_rate = self._gauge("moetune_train_learning_rate", "Learning rate of the last step")
            self.tokens_per_second = self._gauge("moetune_train_tokens_per_second",
                                                 "Trained tokens per second over all ranks in the last step")
            self.tokens = self._counter("moetune_train_tokens", "Trained (non-padding) tokens over all ranks")
            self.tokens.labels(*self.labels.values())  # from 0 before the first step, so rate() sees that step
            self.eval_score = self._gauge("moetune_eval_score", "Generation-based evaluation score (mean over the "
                                                                "evaluation rows, 0..1) at the last evaluation", "metric")
            self.tokens_counted = 0
        self.set_phase("loading")
        self.exporter = Exporter(self.registry, local_rank, address, f"{job_id}-rank{rank}",
                                 settings.metrics_port, settings.metrics_targets_dir)
        for warning in self.exporter.warnings:
            event(f"Rank {rank}: {warning}", level="warn")
        self.moe, self.context, self.context_in_training = None, None, (0, 0.0)

    def _gauge(self, name: str, doc: str, *extra: str) -> Gauge:
        return Gauge(name, doc, [*self.labels, *extra], registry=self.registry)

    def _counter(self, name: str, doc: str, *extra: str) -> Counter:
        return Counter(name, doc, [*self.labels, *extra], registry=self.registry)

    def set_phase(self, phase: str) -> None:
        for p in PHASES:
            self.phase.labels(*self.labels.values(), p).set(1 if p == phase else 0)

    def training_started(self, model, context_parallel: bool, stage: tuple[int, object] | None = None) -> None:
        """Hooks the model's expert-parallel MoE layers and, with `context_parallel`, counts this rank's CP exchanges;
        `stage`: a pipeline stage's index and traffic (workers.engine.pipeline.StageTraffic), exported as counters
        (call before the first forward)."""
        self.moe = MoEMetrics(model, self.registry, self.labels, export_load=self.chief)
        if stage is not None:
            self.registry.register(StageCollector(self.labels, *stage))
        if context_parallel:
            self.context = (self._counter("moetune_context_exchange_sent_bytes", "Context-parallel bytes this rank "
                                          "sent to its CP group (gathered keys and states, their gradients)"),
                            self._counter("moetune_context_exchange_seconds",
                                          "Time this rank spent in context-parallel exchanges"))
            CONTEXT_EXCHANGES.drain()  # from the first step on
            for counter in self.context:
                counter.labels(*self.labels.values())
        self.set_phase("training")
        self.exporter.await_scrape()  # the counters' zeros, so that rate() and increase() count the first step

    def training_part_done(self) -> None:
        """Between a step's training and its validation: the step figures' all-to-all and context-parallel seconds
        are its training's (the report's shares are of training time); the counters take both."""
        if self.moe:
            self.moe.training_part_done()
        if self.context:
            self.context_in_training = CONTEXT_EXCHANGES.drain()

    def step_end(self, record: dict, seconds: float, micro_batch_size: int, grad_accum_steps: int) -> dict:
        """After each optimizer step, on every rank (the expert-load sum is a collective), with the micro-batch
        sizes the step ran with. Returns the step's figures: the MoE layers' (MoEMetrics.step_end) and this rank's
        context-parallel seconds."""
        labels = self.labels.values()
        self.step_seconds.labels(*labels).set(seconds)
        self.micro_batch.labels(*labels).set(micro_batch_size)
        self.grad_accum.labels(*labels).set(grad_accum_steps)
        figures = self.moe.step_end() if self.moe else {}
        if self.context:
            (sent, exchanged), (after_sent, after_exchanged) = self.context_in_training, CONTEXT_EXCHANGES.drain()
            self.context[0].labels(*labels).inc(sent + after_sent)  # after: the step's validation
            self.context[1].labels(*labels).inc(exchanged + after_exchanged)
            figures["context_seconds"], self.context_in_training = exchanged, (0, 0.0)
        if not self.chief:
            return figures
        self.step.labels(*labels).set(record["step"])
        self.total_steps.labels(*labels).set(record["total_steps"])
        self.loss.labels(*labels).set(record["train_loss"])
        if "valid_loss" in record:
            self.valid_loss.labels(*labels).set(record["valid_loss"])
        self.learning_rate.labels(*labels).set(record["learning_rate"])
        self.tokens_per_second.labels(*labels).set(record["tokens_per_second"])
        self.tokens.labels(*labels).inc(record["trained_tokens"] - self.tokens_counted)
        self.tokens_counted = record["trained_tokens"]
        return figures

    def evaluated(self, scores: dict[str, float]) -> None:
        """The scores of an evaluation (metric -> score; rank 0 exports them)."""
        if self.chief:
            for metric, score in scores.items():
                self.eval_score.labels(*self.labels.values(), metric).set(score)

    def close(self) -> None:
        self.exporter.close()
