"""The Ray job that holds a session's worker group: submitted on create and on restart (one submission per
group, `moetune-session-<id>-<attempt>`), stopped on close, asked after when the group has gone quiet, and stopped
with its session failed when it is not ready in time (at a read of the session, and at every pass of the leader's
scheduler: a session nobody reads must not hold its workers)."""

from __future__ import annotations

import logging
import os
import time

from moetune.api.environment import ENV_CALLBACK_URL, ENV_JOB_TOKEN, ENV_RUN_SPEC, ENV_S3_ENDPOINT_URL
from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo
from moetune.api.models.training_sessions import OPEN_STATUSES, SessionCreate, SessionRunSpec
from moetune.service.auth import hash_token, new_job_token
from moetune.service.cluster.ray_jobs import RayJobs, RayUnavailable
from moetune.service.sessions import records
from moetune.service.settings import Settings
from moetune.service.store import SessionRow, Store

log = logging.getLogger("moetune.sessions")
ENTRYPOINT = "python -m moetune.workers.sessions.driver"
_RAY_ENDED = ("STOPPED", "SUCCEEDED", "FAILED")


def submission_id(session_id: str, attempt: int) -> str:
    return f"moetune-{session_id}-{attempt}"


def start_group(store: Store, ray: RayJobs, settings: Settings, session: SessionRow, reason: str,
                restored: tuple[str, int] | None = None) -> None:
    """Submits the Ray job of the session's current group with a fresh token (the previous group's stops working)
    and records its start (`reason`; `restored`: the saved state, name and step, it loads before it takes calls).
    The token is stored once Ray has the job, so a session starting with a token is one whose group Ray was given
    (group_gone may ask after it); the group's first report, `ready`, comes after its model has loaded."""
    token = new_job_token()
    run = SessionRunSpec(session_id=session.id, attempt=session.attempt, spec=SessionCreate.model_validate(
        session.spec), seed=session.seed, output_uri=session.output_uri, restore=restored[0] if restored else None)
    env = {name: os.environ[name] for name in settings.worker_env_passthrough if name in os.environ}
    env.update({ENV_RUN_SPEC: run.model_dump_json(), ENV_CALLBACK_URL: settings.callback_url, ENV_JOB_TOKEN: token})
    if settings.s3_endpoint_url:
        env[ENV_S3_ENDPOINT_URL] = settings.s3_endpoint_url
    ray.submit(submission_id(session.id, session.attempt), ENTRYPOINT, env)
    records.add_group(store, session, reason, restored)
    records.set_session(store, session.id, ("starting",), token_hash=hash_token(token))
    log.info("session %s: worker group %d submitted (%s)", session.id, session.attempt, reason)


def stop_group(ray: RayJobs, session: SessionRow) -> None:
    ray.stop(submission_id(session.id, session.attempt))


def start_overdue(store: Store, settings: Settings, session: SessionRow) -> str | None:
    """Why the session fails for a group that is not ready within session_start_timeout_s of its submission (no
    workers free for it, a model that does not load), or None. A group still being submitted (no token) is not
    timed yet."""
    if session.status != "starting" or session.token_hash is None:
        return None
    group = records.current_group(store, session)
    started = group.created_at if group is not None else session.created_at  # a group from before its rows
    waited = time.time() - started
    if waited <= settings.session_start_timeout_s:
        return None
    return (f"the worker group was not ready {waited:.0f} s after it was submitted (session_start_timeout_s="
            f"{settings.session_start_timeout_s:g}): its workers did not start or its model did not load; its Ray "
            f"job {submission_id(session.id, session.attempt)} was stopped")


def fail_overdue_start(store: Store, settings: Settings, ray: RayJobs, changes, session: SessionRow) -> bool:
    """Fails the session if its group is past session_start_timeout_s, once its Ray job is stopped (its workers
    released; while Ray cannot be reached the session waits for the next look). `changes` wakes the long polls."""
    why = start_overdue(store, settings, session)
    if why is None:
        return False
    try:
        state = ray.state(submission_id(session.id, session.attempt))
        stop_group(ray, session)
    except RayUnavailable:
        return False
    if state is not None:  # Ray's word on where it got to: PENDING is a driver still waiting for resources
        why += f" (it was {state.status}: {state.message or 'no message'})"
    end_session(store, changes, session, "failed", ErrorInfo(code=ErrorCode.session_failed,
                                                              message=f"Not ready in time: {why}."))
    return True


def fail_overdue_starts(store: Store, settings: Settings, ray: RayJobs, changes) -> int:
    """fail_overdue_start for every starting session (the leader's pass); how many failed."""
    return sum(fail_overdue_start(store, settings, ray, changes, row)
               for row in records.sessions_with_status(store, "starting"))


def end_session(store: Store, changes, session: SessionRow, reason: str, error: ErrorInfo | None = None) -> None:
    """Closes (or, with `error`, fails) the open or closing session; its calls not run fail naming why."""
    now = time.time()
    status = "failed" if error else "closed"
    if records.set_session(store, session.id, (*OPEN_STATUSES, "closing"), status=status, closed_at=now,
                           close_reason=reason, error=error.model_dump() if error else None, token_hash=None,
                           gpu_seconds=max(0.0, now - session.created_at) * session.gpus):
        message = error.message if error else f"the session was {reason}"
        records.fail_calls(store, session.id, (records.PENDING, records.RUNNING),
                           ErrorInfo(code=ErrorCode.session_not_open, message=f"Not run: {message}").model_dump())
        changes.notify()


def group_gone(ray: RayJobs, session: SessionRow) -> str | None:
    """Why the open session's group is gone without a word (Ray's status and message), or None while it runs or
    is still being submitted (no token yet: Ray may not know it for a moment, and its submitter fails the session
    when Ray does not take it)."""
    if session.token_hash is None:
        return None
    state = ray.state(submission_id(session.id, session.attempt))
    if state is None:
        return "Ray no longer knows the session's worker group"
    if state.status in _RAY_ENDED:
        return f"the session's Ray job ended ({state.status}): {state.message or 'no message'}"
    return None
