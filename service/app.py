"""The control plane's FastAPI application."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorResponse
from moetune.service.auth import TenantResolver
from moetune.service.base_models import BaseModels
from moetune.service.cluster.leader import LeaderLease
from moetune.service.cluster.scheduler import Scheduler
from moetune.service.console import pages as console
from moetune.service.errors import error_response, install_error_handlers
from moetune.service.metrics import ControlPlaneMetrics, RequestLatencyMiddleware
from moetune.service.readiness import dependency_status
from moetune.service.routes import files, internal, jobs, models, training_sessions, webhooks
from moetune.service.sessions import launch
from moetune.service.sessions.metrics import SessionsCollector
from moetune.service.sessions.waiting import Changes
from moetune.service.settings import Settings
from moetune.service.store import Store
from moetune.service.tinker import routes as tinker
from moetune.service.tinker.state import TinkerState
from moetune.service.submission.storage_facts import StorageFacts
from moetune.service.webhooks.delivery import DeliveryLoop
from moetune.service.webhooks.outbox import enqueue_job_event


class _TrailingSlashIgnored:
    """`/v1/files/` is `/v1/files`: FastAPI's default 307 redirect makes clients resend (or drop) a POST body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope["path"]) > 1 and scope["path"].endswith("/"):
            scope = {**scope, "path": scope["path"].rstrip("/") or "/",
                     "raw_path": scope.get("raw_path", b"").rstrip(b"/") or b"/"}
        await self.app(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    store = Store(settings.database_url)
    store.transitions.subscribe(enqueue_job_event)  # a job's webhook events commit with its change
    lease = LeaderLease(store, settings.scheduler_lease_s, settings.scheduler_lease_renew_s)
    metrics = ControlPlaneMetrics(store, lambda: lease.epoch() is not None, settings.tenant_quotas)
    metrics.registry.register(SessionsCollector(store))
    scheduler = Scheduler(store, settings, on_dependency_error=metrics.count_dependency_error, lease=lease)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await run_in_threadpool(store.migrate)
        if settings.scheduler_enabled:
            scheduler.start()
        deliveries = DeliveryLoop(store, settings)
        delivering = asyncio.create_task(deliveries.run())
        try:
            yield
        finally:
            deliveries.stop()
            await delivering
            await run_in_threadpool(scheduler.stop)
            store.close()

    app = FastAPI(
        title="moetune",
        summary="LoRA fine-tuning of very large Mixture-of-Experts models (OpenAI-compatible job API)",
        version="0.1.0",
        lifespan=lifespan,
        redirect_slashes=False,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.scheduler = scheduler
    app.state.session_changes = Changes()  # wakes the training sessions' long polls

    def fail_overdue_sessions() -> int:  # not only when someone reads the session: its workers are held meanwhile
        return launch.fail_overdue_starts(store, settings, scheduler.ray, app.state.session_changes)

    scheduler.leader_passes.append(fail_overdue_sessions)
    app.state.tinker = TinkerState()
    app.state.tenant_resolver = TenantResolver(settings.tenants_by_token)
    app.state.base_models = BaseModels(settings.base_models)
    app.state.storage_facts = StorageFacts()  # what submission learned from storage, for a few seconds
    install_error_handlers(app)
    app.add_middleware(RequestLatencyMiddleware, histogram=metrics.request_latency)
    app.add_middleware(_TrailingSlashIgnored)
    app.include_router(jobs.router)
    app.include_router(jobs.plans)
    app.include_router(models.models)
    app.include_router(models.deployments)
    app.include_router(models.inference)
    app.include_router(files.router)
    app.include_router(webhooks.router)
    app.include_router(training_sessions.router)
    app.include_router(training_sessions.internal)
    app.include_router(tinker.router)  # Tinker's protocol on the same sessions (service/tinker)
    app.include_router(internal.router)
    app.include_router(console.router)

    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"],
             responses={503: {"model": ErrorResponse, "description": "The database, Ray or the storage is down"}})
    def readyz() -> dict:
        """Each dependency, "ok" or "unreachable"; 503 (naming the ones down) unless all answer."""
        status = dependency_status(store, scheduler.ray, settings, metrics.count_dependency_error)
        if down := [name for name, up in status.items() if not up]:
            return error_response(503, ErrorCode.not_ready, f"Not ready: {', '.join(down)} not reachable.")
        return {"status": "ready", "dependencies": {name: "ok" for name in status}}

    @app.get("/metrics", tags=["ops"], response_class=Response)
    def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
