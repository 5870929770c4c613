"""The control plane's Prometheus metrics, on a registry of its own (several apps can share a process)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moetune.api.models.responses import JobStatus
from moetune.service import quotas
from moetune.service.store import SLOT_STATUSES, Store

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


class _TenantsCollector(Collector):
    """Each tenant's quota usage (and the quotas set), and whether this replica holds the scheduler lease."""

    def __init__(self, store: Store, leads: Callable[[], bool], tenant_quotas: dict[str, quotas.TenantQuota]):
        self.store, self.leads, self.tenant_quotas = store, leads, tenant_quotas

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("moetune_scheduler_leader", "1 while this replica holds the scheduler lease "
                                "(it alone submits jobs), else 0.", value=int(self.leads()))
        try:
            usage = quotas.usage_by_tenant(self.store, self.store.jobs_with_status(*SLOT_STATUSES), time.time())
        except Exception:
            log.exception("could not read tenant usage for /metrics")
            return
        families = {
            "running_jobs": GaugeMetricFamily("moetune_tenant_running_jobs", "Jobs of the tenant holding a slot, "
                                              "and its open training sessions.", labels=["tenant"]),
            "sessions": GaugeMetricFamily("moetune_tenant_training_sessions", "The tenant's open training "
                                          "sessions (counted in its running jobs).", labels=["tenant"]),
            "workers": GaugeMetricFamily("moetune_tenant_workers", "Workers of the tenant's running jobs and open "
                                         "training sessions.", labels=["tenant"]),
            "gpu_hours": GaugeMetricFamily("moetune_tenant_gpu_hours", "GPU-hours the tenant's runs used so far.",
                                           labels=["tenant"]),
        }
        limits = GaugeMetricFamily("moetune_tenant_quota", "The tenant's quota (tenant_quotas; '*' for every "
                                   "tenant not named), by limit.", labels=["tenant", "limit"])
        for tenant, used in sorted(usage.items()):
            for name, family in families.items():
                family.add_metric([tenant], getattr(used, name))
        for tenant, quota in sorted(self.tenant_quotas.items()):
            for name, value in quota.model_dump(exclude_none=True).items():
                limits.add_metric([tenant, name], value)
        yield from families.values()
        yield limits


class ControlPlaneMetrics:
    def __init__(self, store: Store, leads: Callable[[], bool], tenant_quotas: dict[str, quotas.TenantQuota]):
        self.registry = CollectorRegistry()
        self.registry.register(_JobsCollector(store))
        self.registry.register(_TenantsCollector(store, leads, tenant_quotas))
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
