"""The public /v1 routes: thin wrappers over the store and the job service."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response, StreamingResponse

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.layout import report_html_uri, report_json_uri
from moetune.api.models.base import SpecError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.run_config import resolve_run_config
from moetune.api.models.responses import Checkpoint, Job, JobEvent, ListPage
from moetune.api.plans import Plan, PlanRequest
from moetune.api.report import AdaptationReport
from moetune.service import lifecycle
from moetune.service.errors import APIException, invalid_request, job_not_found, documented_errors
from moetune.service.routes.deps import JobView, StoreDep, Tenant
from moetune.service.routes.event_stream import job_event_stream
from moetune.service.store import JobRow, Store
from moetune.service.submission import create as submission, planning
from moetune.service.submission.inputs import resolve_inputs
from moetune.service.submission.job_storage import read_model_config
from moetune.service.submission.uri_policy import check_job_uris
from moetune.service.views import (
    CHECKPOINT_ID_PREFIX,
    EVENT_ID_PREFIX,
    checkpoint_view,
    event_view,
    parse_sequence_id,
)

# Every error body is an ErrorResponse (the schema says so, replacing FastAPI's own 422 shape).
_ERRORS = documented_errors(
    (400, "The request body could not be parsed"),
    (401, "Missing or invalid API token"),
    (404, "No such job for this tenant"),
    (409, "The job's status does not allow this change, or the Idempotency-Key was used for another request"),
    (422, "Invalid request; `error.param` names the field"),
)
# The same errors for a route whose success is not JSON (FastAPI files an error model under the route's media type)
_JSON_ERRORS = {code: {"description": error["description"], "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}} for code, error in _ERRORS.items()}
router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], responses=_ERRORS)
plans = APIRouter(prefix="/v1/fine_tuning/plans", tags=["fine-tuning"], responses=_ERRORS)

Limit = Annotated[int, Query(ge=1, le=100)]


def _own_job(store: Store, tenant: str, job_id: str, param: str | None = None) -> JobRow:
    """The tenant's job; another tenant's job is exactly as unknown as a missing one."""
    job = store.get_job(job_id, tenant)
    if job is None:
        raise job_not_found(job_id, param)
    return job


def _cursor(value: str | None, prefix: str, param: str = "after") -> int | None:
    if value is None:
        return None
    seq = parse_sequence_id(value, prefix)
    if seq is None:
        raise invalid_request(f"{param}: expected an id like '{prefix}123'", param)
    return seq


def _page(rows: list, has_more: bool, view) -> ListPage:
    data = [view(r) for r in rows]
    return ListPage(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.post("", response_model=Job)
def create_job(request: Request, body: JobCreate, tenant: Tenant, store: StoreDep, job_view: JobView,
               idempotency_key: Annotated[str | None, Header(max_length=255)] = None) -> Job:
    state = request.app.state
    return job_view(submission.create_job(store, state.settings, tenant, body, state.base_models, idempotency_key,
                                          state.storage_facts))


@router.get("", response_model=ListPage[Job])
def list_jobs(tenant: Tenant, store: StoreDep, job_view: JobView, after: str | None = None,
              limit: Limit = 20) -> ListPage[Job]:
    cursor = _own_job(store, tenant, after, param="after") if after else None
    return _page(*store.list_jobs(tenant, limit, cursor), job_view)


@router.get("/{job_id}", response_model=Job)
async def retrieve_job(job_id: str, tenant: Tenant, store: StoreDep, job_view: JobView) -> Response:
    """The most polled route (SDK wait, CLI, dashboards). A SQLite lookup is a local read shorter than a hop
    to a worker thread, so it runs on the event loop; a database over the network is read from a thread. The
    view is serialized once here: returned as a model, FastAPI would validate it again against response_model."""
    row = store.read_job(job_id, tenant) if store.reads_are_local else \
        await run_in_threadpool(store.read_job, job_id, tenant)
    if row is None:
        raise job_not_found(job_id)
    return Response(job_view(row).model_dump_json(), media_type="application/json")


@router.post("/{job_id}/cancel", response_model=Job)
def cancel_job(job_id: str, tenant: Tenant, store: StoreDep, job_view: JobView) -> Job:
    lifecycle.cancel(store, _own_job(store, tenant, job_id))
    return job_view(_own_job(store, tenant, job_id))


@router.post("/{job_id}/pause", response_model=Job)
def pause_job(job_id: str, tenant: Tenant, store: StoreDep, job_view: JobView) -> Job:
    """A running job becomes `pausing` until its workers have checkpointed and stopped, then `paused`."""
    lifecycle.pause(store, _own_job(store, tenant, job_id))
    return job_view(_own_job(store, tenant, job_id))


@router.post("/{job_id}/resume", response_model=Job)
def resume_job(job_id: str, tenant: Tenant, store: StoreDep, job_view: JobView) -> Job:
    """A paused job is queued again and continues from its last checkpoint."""
    lifecycle.resume(store, _own_job(store, tenant, job_id))
    return job_view(_own_job(store, tenant, job_id))


@router.get(
    "/{job_id}/events",
    response_model=ListPage[JobEvent],
    responses={200: {"content": {"text/event-stream": {}},
                     "description": "A page of events, or with ?stream=true a live SSE stream"}},
)
def list_events(
    job_id: str,
    request: Request,
    tenant: Tenant,
    store: StoreDep,
    after: str | None = None,
    limit: Limit = 20,
    stream: bool = False,
    last_event_id: Annotated[str | None, Header()] = None,
):
    job = _own_job(store, tenant, job_id)
    if stream or "text/event-stream" in request.headers.get("accept", ""):
        # On reconnect the browser resends the original URL plus Last-Event-ID, which is the newer cursor.
        after_seq = (_cursor(last_event_id, EVENT_ID_PREFIX, "Last-Event-ID") if last_event_id
                     else _cursor(after, EVENT_ID_PREFIX))
        return StreamingResponse(job_event_stream(store, job.id, after_seq), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    # Newest first, as OpenAI's list (its SDK pages with `after` = the page's last, i.e. oldest, event).
    return _page(*store.list_events(job.id, limit, _cursor(after, EVENT_ID_PREFIX), newest_first=True), event_view)


@router.get("/{job_id}/checkpoints", response_model=ListPage[Checkpoint])
def list_checkpoints(job_id: str, tenant: Tenant, store: StoreDep, after: str | None = None,
                     limit: Limit = 10) -> ListPage[Checkpoint]:
    job = _own_job(store, tenant, job_id)
    return _page(*store.list_checkpoints(job.id, limit, _cursor(after, CHECKPOINT_ID_PREFIX)), checkpoint_view)


def _report_bytes(request: Request, job: JobRow, uri: str) -> bytes:
    try:
        return storage.read_bytes(uri, endpoint_url=request.app.state.settings.s3_endpoint_url)
    except FileNotFoundError:
        raise APIException(404, ErrorCode.report_not_found, f"Job {job.id} has no adaptation report (the driver "
                           f"writes it when the job succeeds; status: {job.status}).") from None


@router.get("/{job_id}/report", response_model=AdaptationReport)
def get_report(job_id: str, request: Request, tenant: Tenant, store: StoreDep) -> Response:
    """The job's adaptation report (api.report), as the driver wrote it next to the adapter."""
    job = _own_job(store, tenant, job_id)
    return Response(_report_bytes(request, job, report_json_uri(job.output_uri)), media_type="application/json")


@router.get("/{job_id}/report.html", response_class=HTMLResponse, responses=_JSON_ERRORS)
def get_report_page(job_id: str, request: Request, tenant: Tenant, store: StoreDep) -> HTMLResponse:
    """The same report as one self-contained page (inline SVG plots, nothing fetched)."""
    job = _own_job(store, tenant, job_id)
    return HTMLResponse(_report_bytes(request, job, report_html_uri(job.output_uri)))


@plans.post("", responses=documented_errors((503, "The memory planner did not answer")))
def create_plan(request: Request, body: PlanRequest, tenant: Tenant, store: StoreDep) -> Plan:
    """Per-GPU memory of a job on a described cluster, the fastest layout that fits (estimated) and the fewest GPUs
    (workers.planner)."""
    settings = request.app.state.settings
    job = resolve_inputs(body.job, store, tenant, request.app.state.base_models)  # names and file ids
    check_job_uris(job, tenant, settings)
    try:
        run_config = resolve_run_config(job, job.seed or 0, planning=True)  # the seed changes no byte of the plan
        config = read_model_config(job.model, settings.s3_endpoint_url, request.app.state.storage_facts)
    except SpecError as e:
        raise invalid_request(e.message, e.param) from None
    if config is None:
        raise invalid_request(f"job.model: cannot read {job.model.rstrip('/')}/config.json", "job.model")
    return planning.plan_or_error(config, run_config, job.training.activation_checkpointing == "auto", body.cluster)
