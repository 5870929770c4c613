"""The control plane's Prometheus metrics, on a registry of its own (several apps can share a process)."""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moetune.api.models.responses import JobStatus
from moetune.service.store import Store

log = logging.getLogger(__name__)

DEPENDENCIES = ("database", "ray", "storage")


class _JobsCollector(Collector):
    """Job counts read from the store at scrape time, so every replica reports the same truth."""

    def __init__(self, store: Store):
        self.store = store

    def describe(self):
        return []  # nothing to query at registration time

    def collect(self):
        try:
            counts = self.store.count_by_status()
        except Exception:
            log.exception("could not count jobs for /metrics")
            return
        jobs = GaugeMetricFamily("moetune_jobs", "Fine-tuning jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status.value], counts.get(status.value, 0))
        yield jobs
        yield GaugeMetricFamily("moetune_queue_depth", "Jobs waiting for a Ray slot (status queued).",
                                value=counts.get(JobStatus.queued.value, 0))


class ControlPlaneMetrics:
    def __init__(self, store: Store):
        self.registry = CollectorRegistry()
        self.registry.register(_JobsCollector(store))
        self.request_latency = Histogram(
            "moetune_http_request_duration_seconds",
            "Time until the response headers are sent, by route template.",
            ["method", "route", "status_code"],
            registry=self.registry,
        )

        self.dependency_errors = Counter(
            "moetune_dependency_errors",
            "Calls of the control plane to a dependency that failed (Ray unreachable, storage not answering).",
            ["dependency"],
            registry=self.registry,
        )
        for dependency in DEPENDENCIES:
            self.dependency_errors.labels(dependency)  # every series exists from the start, at 0

    def count_dependency_error(self, dependency: str) -> None:
        self.dependency_errors.labels(dependency).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestLatencyMiddleware:
    """Times each request until its response starts (so an SSE stream counts once, not for its whole life)."""

    def __init__(self, app: ASGIApp, histogram: Histogram):
        self.app = app
        self.histogram = histogram

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        observed = False

        def observe(status: int) -> None:
            nonlocal observed
            observed = True
            # The route template, not the path, keeps job ids out of the label values.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.histogram.labels(scope["method"], route, str(status)).observe(time.perf_counter() - start)

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not observed:
                observe(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        except Exception:
            if not observed:
                observe(500)
            raise
