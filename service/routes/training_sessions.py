"""Training sessions: `/v1/training_sessions` for the user's loop (create, calls, close, restart, deploy of saved
weights) and the internal routes a session's worker group takes its calls from (authenticated by the group's own
token). A ready group that fails is replaced by one resuming from the newest saved state (`_recover`); one not
ready within session_start_timeout_s fails the session and is stopped (launch.fail_overdue_start: at a read of the
session here, and at each pass of the leader's scheduler)."""

from __future__ import annotations

import random
import time

from fastapi import APIRouter, Body, Query, Request

from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo, ListPage
from moetune.api.serving import Deployment
from moetune.api.models.training_sessions import (
    OPEN_STATUSES,
    SESSION_INTERNAL,
    CallArgs,
    CallCreate,
    CallOutcome,
    GroupEnded,
    NextCall,
    SessionCall,
    SessionCreate,
    TakenCall,
    TrainingSession,
)
from moetune.service.auth import bearer_token, job_token_matches, unauthorized
from moetune.service import quotas
from moetune.service.cluster import deployments as recorded_deployments, serve_deploy
from moetune.service.cluster.ray_jobs import RayUnavailable
from moetune.api.models.base import SpecError
from moetune.service.errors import APIException, invalid_request, documented_errors
from moetune.service.routes.deps import StoreDep, Tenant
from moetune.service.sessions import launch, records
from moetune.service.sessions.weights import saved_weights
from moetune.service.store import CallRow, SessionRow, Store

router = APIRouter(prefix="/v1/training_sessions", tags=["training sessions"], responses=documented_errors(
        (400, "The request body could not be parsed"),
        (401, "Missing or invalid API token"),
        (404, "No such session (or call) for this tenant"),
        (409, "The session is not open"),
        (422, "Invalid session or call; `error.param` names the field"),
        (429, "The cluster's running slots (max_running_jobs) or the tenant's quota (running jobs and sessions, "
         "workers, GPU-hours) leave no room for the session"),
        (503, "Ray (or Ray Serve) cannot be reached now: nothing changed; retry after `Retry-After` seconds"),
    ))
internal = APIRouter(prefix=SESSION_INTERNAL, tags=["internal"], include_in_schema=False)
_MAX_WAIT_S = 60.0


def _view(store: Store, row: SessionRow) -> TrainingSession:
    group = records.current_group(store, row)
    return TrainingSession(id=row.id, status=row.status, model=row.spec["model"], created_at=int(row.created_at),
                           closed_at=int(row.closed_at) if row.closed_at else None,
                           idle_timeout_s=row.spec["idle_timeout_s"], output_uri=row.output_uri,
                           restarts=row.attempt, recoveries=row.recoveries, close_reason=row.close_reason,
                           error=row.error, restored_state=group.result["restored_state"] if group else None,
                           restored_step=group.result["restored_step"] if group else 0)


def _call_view(row: CallRow) -> SessionCall:
    return SessionCall(id=row.id, session_id=row.session_id, kind=row.kind, status=row.status,
                       created_at=row.created_at, finished_at=row.finished_at, result=row.result, error=row.error)


def _own(request: Request, store: Store, tenant: str, session_id: str, ask_ray: bool = False) -> SessionRow:
    """The tenant's session. `ask_ray`: one whose group vanished without a word (Ray lost it, the driver was killed)
    is recovered or failed first, and one whose group is not ready within its start timeout fails (a question to
    Ray's Jobs API: not on every call)."""
    row = records.get_session(store, session_id, tenant)
    if row is None:
        raise APIException(404, ErrorCode.not_found, f"No training session with id {session_id!r}.")
    if ask_ray and row.status in OPEN_STATUSES:
        try:
            why = launch.group_gone(request.app.state.scheduler.ray, row)
        except RayUnavailable:  # no answer is not "gone": the session stays as stored until Ray answers
            why = None
        if why:
            _recover(request, row, ErrorInfo(code=ErrorCode.driver_failed, message=why))
            row = records.get_session(store, session_id, tenant)
        elif _fail_overdue_start(request, row):
            row = records.get_session(store, session_id, tenant)
    return row


def _fail_overdue_start(request: Request, row: SessionRow) -> bool:
    state = request.app.state
    return launch.fail_overdue_start(state.store, state.settings, state.scheduler.ray, state.session_changes, row)


def _stop(request: Request, row: SessionRow, what: str) -> None:
    """Stops the session's group; while Ray cannot be reached, a retryable 503 before anything changed."""
    try:
        launch.stop_group(request.app.state.scheduler.ray, row)
    except RayUnavailable as e:
        raise APIException(503, ErrorCode.not_ready, f"{e}: the session was not {what}; retry later.",
                           headers={"Retry-After": "5"}) from None


def _end(request: Request, row: SessionRow, reason: str, error: ErrorInfo | None = None) -> None:
    launch.end_session(request.app.state.store, request.app.state.session_changes, row, reason, error)


def _start(request: Request, row: SessionRow, reason: str, restored: tuple[str, int] | None = None) -> None:
    """Submits the session's current group (loading saved state `restored` first, given); when Ray cannot take it
    the session fails and the caller gets a 503."""
    try:
        launch.start_group(request.app.state.store, request.app.state.scheduler.ray, request.app.state.settings, row,
                           reason, restored)
    except RayUnavailable as e:
        _end(request, row, "failed", ErrorInfo(code=ErrorCode.driver_failed, message=str(e)))
        raise APIException(503, ErrorCode.not_ready, f"{e}: the session's worker group was not started.",
                           headers={"Retry-After": "5"}) from None


def _resumed_from(store: Store, row: SessionRow, fresh: bool = False) -> tuple[tuple[str, int] | None, dict, str]:
    """What a new group of the session resumes from: the newest saved state (name, step), as a failed group's
    replacement and a restart do, or None, a fresh LoRA (before the first save_state, or `fresh` asked for); the
    result the calls failed by the change carry; it in words."""
    state = None if fresh else records.newest_state(store, row)
    if state is None:
        return None, {"restored_state": None, "restored_step": 0}, \
            "a fresh LoRA (" + ("asked for" if fresh else "no state was saved") + ")"
    return state, {"restored_state": state[0], "restored_step": state[1]}, f"state {state[0]!r} (step {state[1]})"


def _recover(request: Request, row: SessionRow, cause: ErrorInfo) -> None:
    """The session's group died (a worker, its driver or Ray lost it). A group that was ready is replaced by one
    loading the newest saved state, at most `max_recoveries` times; the calls it did not finish, and those queued
    for it (they assumed its state), fail as session_restarted naming that state. Otherwise the session fails."""
    store = request.app.state.store
    if row.status != "ready" or row.recoveries >= row.spec.get("max_recoveries", 0):
        _end(request, row, "failed", cause)  # one that never got ready fails alike the next time: no loop
        return
    if not records.set_session(store, row.id, ("ready",), group=row.attempt, status="starting", token_hash=None,
                               attempt=row.attempt + 1, recoveries=row.recoveries + 1):
        return  # another report of the same loss got there first
    state, restored, resumes = _resumed_from(store, row)
    message = f"The worker group failed ({cause.message}); a new one resumes from {resumes}."
    records.fail_calls(store, row.id, (records.RUNNING, records.PENDING),
                       ErrorInfo(code=ErrorCode.session_restarted, message=message).model_dump(), restored)
    try:
        launch.start_group(store, request.app.state.scheduler.ray, request.app.state.settings,
                           records.get_session(store, row.id), "recovery", state)
    except RayUnavailable as e:
        _end(request, row, "failed", ErrorInfo(code=ErrorCode.driver_failed, message=f"{message} Ray did not take "
                                                                                      f"the new group: {e}"))
    request.app.state.session_changes.notify()


def _open(row: SessionRow) -> None:
    if row.status not in OPEN_STATUSES:
        raise APIException(409, ErrorCode.session_not_open, f"Training session {row.id} is {row.status}"
                           + (f" ({row.close_reason})" if row.close_reason else "") + ": it takes no more calls.")


@router.post("", response_model=TrainingSession)
def create(spec: SessionCreate, request: Request, tenant: Tenant, store: StoreDep) -> TrainingSession:
    """Starts a worker group holding a fresh LoRA on the base; calls may be queued at once (they run once it is up,
    status `ready`)."""
    settings = request.app.state.settings
    model = spec.model if "://" in spec.model else request.app.state.base_models.uri(spec.model)
    if model is None:
        raise invalid_request(f"model: no registered base model is named {spec.model!r} (GET /v1/models lists "
                              f"them; a checkpoint folder's URI works too)", "model")
    par = spec.parallelism
    try:  # the layout's rules, as a job's (its config.json's are the driver's: a session reads no data first)
        par.check_world()
    except SpecError as e:
        raise invalid_request(e.message, e.param) from None
    for field in ("context_parallel_size", "pipeline_parallel_size"):
        if getattr(par, field) > 1:
            raise invalid_request(f"parallelism.{field}: a training session runs each call's batch whole on its "
                                  f"ranks; context parallelism and pipeline stages are for supervised jobs",
                                  f"parallelism.{field}")
    session_id = records.new_id("ts")
    with store.slots_locked():  # checked and inserted as one: two creates at once cannot both take the last place
        quotas.check_session(store, settings.tenant_quotas, tenant, par, settings.max_running_jobs)
        row = records.add_session(store, SessionRow(
            id=session_id, tenant=tenant, status="starting", created_at=time.time(),
            spec=spec.model_copy(update={"model": model}).model_dump(mode="json"),
            seed=spec.seed if spec.seed is not None else random.randrange(2**31),
            output_uri=f"{(spec.output_uri or settings.default_output_uri).rstrip('/')}/{session_id}", attempt=0,
            workers=par.num_workers, gpus=par.num_workers * par.gpus_per_worker))
    _start(request, row, "created")
    return _view(store, records.get_session(store, session_id))


@router.get("", response_model=ListPage[TrainingSession])
def list_(tenant: Tenant, store: StoreDep, limit: int = 20) -> ListPage[TrainingSession]:
    rows, has_more = records.list_sessions(store, tenant, max(1, min(limit, 100)))
    data = [_view(store, r) for r in rows]
    return ListPage(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{session_id}", response_model=TrainingSession)
def retrieve(session_id: str, request: Request, tenant: Tenant, store: StoreDep) -> TrainingSession:
    return _view(store, _own(request, store, tenant, session_id, ask_ray=True))


@router.post("/{session_id}/close", response_model=TrainingSession)
def close(session_id: str, request: Request, tenant: Tenant, store: StoreDep) -> TrainingSession:
    """The group finishes the call it runs and stops; queued calls are not run. Save the state first to keep it."""
    row = _own(request, store, tenant, session_id)
    _open(row)
    if row.status == "starting" or not records.set_session(store, row.id, ("ready",), status="closing"):
        _stop(request, row, "closed")  # not taking calls yet: nothing to finish
        _end(request, row, "closed")
    request.app.state.session_changes.notify()
    return _view(store, records.get_session(store, session_id))


@router.post("/{session_id}/restart", response_model=TrainingSession)
def restart(session_id: str, request: Request, tenant: Tenant, store: StoreDep, fresh: bool = Query(
        False, description="Start the new group from a fresh LoRA instead of the newest saved state (later "
                           "recoveries then resume from states saved after this restart only)")) -> TrainingSession:
    """Replaces the worker group by a new one resuming from the newest saved state, as a failed group's replacement
    does (a fresh LoRA before the first save_state, or with `fresh=true`): the call the old group runs fails naming
    what the new one resumes from, queued calls wait for the new group. The answer's `restored_state` and
    `restored_step` say which (null and 0: a fresh LoRA)."""
    row = _own(request, store, tenant, session_id)
    _open(row)
    _stop(request, row, "restarted")  # the old group first: a Ray that cannot be reached leaves the session as it is
    if not records.set_session(store, row.id, OPEN_STATUSES, group=row.attempt, status="starting", token_hash=None):
        raise APIException(409, ErrorCode.session_not_open, f"Training session {row.id} changed meanwhile; retry.")
    state, restored, resumes = _resumed_from(store, row, fresh)
    restarted = ErrorInfo(code=ErrorCode.session_restarted,
                          message=f"The worker group was restarted while it ran this call; the new one resumes from "
                                  f"{resumes}.")
    records.fail_calls(store, row.id, (records.RUNNING,), restarted.model_dump(), restored)
    records.set_session(store, row.id, ("starting",), group=row.attempt, attempt=row.attempt + 1)
    _start(request, records.get_session(store, row.id), "restart", state)
    request.app.state.session_changes.notify()
    return _view(store, records.get_session(store, session_id))


@router.post("/{session_id}/weights/{name}/deploy", response_model=Deployment)
def deploy_weights(session_id: str, name: str, request: Request, tenant: Tenant, store: StoreDep) -> Deployment:
    """Makes the Serve app serve the session's base; the weights saved under `name` load on first use, called by
    the returned model name (the session may be closed by then)."""
    row = _own(request, store, tenant, session_id)
    settings, base_models = request.app.state.settings, request.app.state.base_models
    found = saved_weights(store, base_models, tenant, row.id, name)
    if not found:
        raise APIException(404, ErrorCode.not_found, f"Training session {row.id} saved no weights named {name!r} "
                                                     "(save_weights saves them).", "name")
    served = found[0].moetune
    status = recorded_deployments.deploy(store, settings, {served.base_model: served.base_model_uri})
    return Deployment(model=found[0].id, base_model=served.base_model,
                      base_url=serve_deploy.openai_base_url(settings.serve_url), status=status)


@router.post("/{session_id}/calls", response_model=SessionCall)
def add_call(session_id: str, body: CallCreate, request: Request, tenant: Tenant,
             store: StoreDep) -> SessionCall:
    """Queues a call; the session's calls run one at a time in the order they were queued."""
    if getattr(body.call, "uri", None) is not None:  # another session's state: the Tinker router vouches for it
        raise invalid_request("call.uri: set by the control plane only (load_state takes a name saved by this "
                              "session)", "call.uri")
    return queue_call(session_id, body.call, request, tenant, store)


def queue_call(session_id: str, args: CallArgs, request: Request, tenant: str, store: Store) -> SessionCall:
    """Queues `args` on the tenant's open session (the HTTP route's checks done, or the caller's own)."""
    row = _own(request, store, tenant, session_id)
    _open(row)
    call = records.add_call(store, row.id, args.kind, args.model_dump(mode="json"))
    request.app.state.session_changes.notify()
    return _call_view(call)


@router.get("/{session_id}/calls/{call_id}", response_model=SessionCall)
def get_call(session_id: str, call_id: str, request: Request, tenant: Tenant, store: StoreDep,
             wait_s: float = 0.0) -> SessionCall:
    """The call; `wait_s` > 0 waits up to that long (at most 60 s) for it to finish."""
    _own(request, store, tenant, session_id)

    def finished():
        row = records.get_call(store, session_id, call_id)
        if row is None:
            raise APIException(404, ErrorCode.not_found, f"No call with id {call_id!r} in session {session_id}.")
        return row if row.status in (records.SUCCEEDED, records.FAILED) else None

    row = request.app.state.session_changes.wait_for(finished, min(max(wait_s, 0.0), _MAX_WAIT_S))
    if row is None and wait_s > 0:  # a long wait in vain: is the group still there to run it?
        _own(request, store, tenant, session_id, ask_ray=True)
    return _call_view(row or records.get_call(store, session_id, call_id))


# ---------------------------------------------------------------- the group's side


def _group(request: Request, session_id: str, attempt: int) -> SessionRow:
    """The session whose current group's token was presented; a replaced group or an ended session gets a 409."""
    row = records.get_session(request.app.state.store, session_id)
    if row is None or not job_token_matches(bearer_token(request), row.token_hash):
        if row is not None and (row.attempt != attempt or row.token_hash is None):
            raise APIException(409, ErrorCode.session_not_open,
                               f"Group {attempt} of session {session_id} no longer serves.")
        raise unauthorized("Invalid session token.", code=ErrorCode.invalid_job_token)
    return row


@internal.post("/ready")
def ready(session_id: str, attempt: int, request: Request) -> dict:
    _group(request, session_id, attempt)
    records.set_session(request.app.state.store, session_id, ("starting",), group=attempt, status="ready")
    return {}


@internal.post("/next_call", response_model=NextCall)
def next_call(session_id: str, attempt: int, request: Request, wait_s: float = Body(10.0, embed=True)) -> NextCall:
    store = request.app.state.store

    def answer():
        row = _group(request, session_id, attempt)
        if row.status == "closing":
            return NextCall(close=True)
        taken = records.take_calls(store, session_id, attempt)
        if not taken:
            return None
        return NextCall(calls=[TakenCall(call_id=call.id, number=number, call=call.args) for call, number in taken])

    return request.app.state.session_changes.wait_for(answer, min(max(wait_s, 0.0), _MAX_WAIT_S)) or NextCall()


@internal.post("/calls/{call_id}")
def call_outcome(session_id: str, call_id: str, attempt: int, body: CallOutcome, request: Request) -> dict:
    _group(request, session_id, attempt)
    records.finish_call(request.app.state.store, call_id, attempt, body.result,
                        body.error.model_dump() if body.error else None)
    request.app.state.session_changes.notify()
    return {}


@internal.post("/ended")
def ended(session_id: str, attempt: int, body: GroupEnded, request: Request) -> dict:
    row = _group(request, session_id, attempt)
    if body.reason == "failed":
        _recover(request, row, body.error or ErrorInfo(code=ErrorCode.session_failed, message="no cause given"))
    else:
        _end(request, row, body.reason, body.error)
    return {}
