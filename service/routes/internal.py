"""The route workers report through: events, metrics, checkpoints and the final result of one job."""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Header, Request
from pydantic import ValidationError

from moetune.api.errors import ErrorCode
from moetune.api.layout import CHECKPOINT_MANIFEST, checkpoint_uri, manifest_uri, step_dir
from moetune.api.models.base import SpecError
from moetune.api.models.job_run import REPORT_PATH, CheckpointReport, EventReport, ReportAck, WorkerReport
from moetune.api.models.responses import JobStatus, Progress
from moetune.service.auth import bearer_token, job_token_matches, unauthorized
from moetune.service.errors import APIException, invalid_request
from moetune.service.lifecycle import finish_job
from moetune.service.routes.deps import StoreDep
from moetune.service.store import JobRow, ReportKey, Store
from moetune.service.submission.job_storage import read_json

router = APIRouter(tags=["internal"], include_in_schema=False)
log = logging.getLogger("moetune.reports")
_ENDED = [s for s in JobStatus if s.terminal]
_ETA_ORIGIN = "eta_origin"  # [step, epoch seconds] in JobRow.progress


def _reporting_job(job_id: str, request: Request, store: StoreDep) -> JobRow:
    """The job whose worker token was presented; unknown jobs get the same 401 (no id oracle)."""
    job = store.get_job(job_id)
    if job is None or not job_token_matches(bearer_token(request), job.job_token_hash):
        raise unauthorized("Invalid job token.", code=ErrorCode.invalid_job_token)
    return job


def estimate_finish(origin_at: float | None, origin_step: int, step: int, total_steps: int | None,
                    now: float) -> float | None:
    """Linear extrapolation of the time per step since the attempt's first reported step (`origin_step` at
    `origin_at`): the start-up before it (Ray, weights, compilation) is no step's cost. None before a second step."""
    if origin_at is None or not total_steps or step <= origin_step:
        return None
    return now + (now - origin_at) / (step - origin_step) * max(total_steps - step, 0)


def _progress_updater(data: dict):
    """Merges a metrics event's data into the job row (a job that already ended keeps its last values)."""
    try:
        merged = Progress.model_validate(data)  # checks the known fields before anything is stored
    except ValidationError as e:
        raise invalid_request(f"metrics data: {e.errors()[0]['msg']}", "report.data") from None
    fields = merged.model_dump(exclude_unset=True, exclude_none=True)

    def update(job: JobRow) -> None:
        if JobStatus(job.status).terminal:
            return
        now, progress = time.time(), {**(job.progress or {}), **fields}
        step = progress.get("step", 0)
        # The ETA's origin, this attempt's first reported step, is kept in the stored progress (the view's
        # Progress model leaves it out); a resumed attempt starts a new one.
        origin = progress.get(_ETA_ORIGIN)
        if step and (origin is None or origin[1] < (job.started_at or 0)):
            progress[_ETA_ORIGIN] = origin = [step, now]
        job.progress = progress
        if data.get("trained_tokens") is not None:
            job.trained_tokens = int(data["trained_tokens"])
        origin_step, origin_at = origin or (0, None)
        job.estimated_finish = estimate_finish(origin_at, origin_step, step, progress.get("total_steps"), now)

    return update


def _refuse_after_end(job: JobRow, report) -> APIException:
    """A report for a job that already ended (workers outliving a cancel, an orphaned Ray head training on after the
    job was marked lost) is never part of its history: logged, and a 409 the reporter does not retry."""
    log.warning("job %s is %s: refused its workers' %s report", job.id, job.status, report.kind)
    return APIException(409, ErrorCode.job_ended, f"job {job.id} already {job.status}: its workers' reports are "
                        "no longer recorded", "report")


def _report_key(header: str | None) -> ReportKey | None:
    """A worker report's Idempotency-Key, `<outbox stream>:<sequence number>` (workers/reporting/outbox.py), unique
    within its job; None without one."""
    if header is None:
        return None
    stream, _, seq = header.rpartition(":")
    if not stream or len(stream) > 64 or not seq.isdigit():
        raise invalid_request("Idempotency-Key must be <stream>:<sequence number> (a stream of at most 64 "
                              "characters)", "Idempotency-Key")
    return stream, int(seq)


def _check_complete(job: JobRow, report: CheckpointReport, s3_endpoint_url: str | None) -> None:
    """Only a complete checkpoint of this job is listed: its own step directory, manifest present. While storage
    cannot be read the answer is a 503, which the worker retries: a 409 would make it drop the report for good, and
    the checkpoint would never be listed (reports queued through a control-plane outage meet a storage one so)."""
    expected = checkpoint_uri(job.output_uri, report.step_number)
    if report.uri.rstrip("/") != expected:
        raise invalid_request(f"checkpoint uri must be {expected}", "report.uri")
    try:
        manifest = read_json(manifest_uri(expected), s3_endpoint_url, strict=True)
    except (FileNotFoundError, SpecError):  # storage answered: no manifest, or one no writer of ours made
        manifest = {}
    if manifest is None:
        raise APIException(503, ErrorCode.storage_unavailable, f"storage cannot be read now to check that checkpoint "
                           f"{expected} is complete; retry")
    if manifest.get("step") != report.step_number:
        raise APIException(409, ErrorCode.checkpoint_incomplete, f"checkpoint {expected} is not complete: no "
                           f"{CHECKPOINT_MANIFEST} for step {report.step_number}", "report.uri")


@router.post(REPORT_PATH)
def post_report(job: Annotated[JobRow, Depends(_reporting_job)], body: Annotated[WorkerReport, Body()],
                store: StoreDep, request: Request,
                idempotency_key: Annotated[str | None, Header(max_length=100)] = None) -> ReportAck:
    """Accepts a report, each Idempotency-Key once (a redelivery is acknowledged, not stored again); the reply says
    "pause" while the user's pause waits for the workers."""
    report, key = body.report, _report_key(idempotency_key)
    if key is not None and store.delivered_before(job.id, key):  # its acknowledgement was lost: the same again
        return _ack(store, job)
    if JobStatus(job.status).terminal:
        raise _refuse_after_end(job, report)
    if isinstance(report, EventReport):
        updater = _progress_updater(report.data) if report.type == "metrics" and report.data else None
        # unless_status: the job may end between the check above and this transaction
        if not store.add_event(job.id, report.message, report.level, report.type, report.data, change_job=updater,
                               unless_status=_ENDED, report_key=key):
            raise _refuse_after_end(job, report)
    elif isinstance(report, CheckpointReport):
        _check_complete(job, report, request.app.state.settings.s3_endpoint_url)
        retired = "".join(f"; retired {step_dir(s)}" for s in report.retired_steps)
        store.add_checkpoint(job.id, report.step_number, report.uri, report.metrics.model_dump(),
                             report.retired_steps, report_key=key,
                             event=(f"Checkpoint saved at step {report.step_number}: {report.uri}{retired}",
                                    {"step": report.step_number, "uri": report.uri,
                                     "retired_steps": report.retired_steps}))
    else:
        # A result changes the job's status only from an active one: a redelivery racing this one changes nothing.
        if not request.app.state.scheduler.requeue_if_head_lost(job, report):
            finish_job(store, job, report)
        if key is not None:
            store.note_delivered(job.id, key)
    return _ack(store, job)


def _ack(store: Store, job: JobRow) -> ReportAck:
    """Asks the workers to pause while the user's pause waits for them."""
    return ReportAck(control="pause" if store.get_job(job.id).status == JobStatus.pausing else None)
