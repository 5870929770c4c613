"""A job's status changes that users and workers ask for: cancel, pause, resume and the driver's final word.

Every change is one conditional store transition, so a user, a worker report and the scheduler can race
without one overwriting another's decision; a change the job's status does not allow is a 409.
"""

from __future__ import annotations

from moetune.api.errors import ErrorCode
from moetune.api.models.job_run import ResultReport
from moetune.api.models.responses import ErrorInfo, JobStatus
from moetune.service.errors import APIException
from moetune.service.store import ACTIVE_STATUSES, SLOT_STATUSES, JobRow, Store


def _conflict(store: Store, job: JobRow, code: ErrorCode, wanted: str, allowed: str) -> APIException:
    status = store.get_job(job.id).status
    return APIException(409, code, f"Job {job.id} is {status}: only {allowed} jobs can be {wanted}.")


def cancel(store: Store, job: JobRow) -> None:
    # A Ray submission is stopped by the scheduler (cancel_requested).
    if not store.transition(job.id, ACTIVE_STATUSES, JobStatus.cancelled, "Job cancelled", cancel_requested=True):
        raise APIException(409, ErrorCode.job_not_cancellable,
                           f"Job {job.id} has already finished with status {store.get_job(job.id).status}.")


def pause(store: Store, job: JobRow) -> None:
    """A running job checkpoints at its next step end (the report ack tells its workers); one not started yet
    simply stops waiting for a slot."""
    if store.transition(job.id, [JobStatus.running], JobStatus.pausing,
                        "Pause requested: the workers checkpoint at the end of the current step and stop"):
        return
    if not store.transition(job.id, [JobStatus.validating_files, JobStatus.queued], JobStatus.paused, "Job paused"):
        raise _conflict(store, job, ErrorCode.job_not_pausable, "paused", "validating_files, queued or running")


def resume(store: Store, job: JobRow) -> None:
    """Back into the queue; the next attempt continues from the newest complete checkpoint."""
    if not store.transition(job.id, [JobStatus.paused], JobStatus.queued,
                            "Job resumed: queued to continue from its last checkpoint",
                            attempt=JobRow.attempt + 1, cancel_requested=False):
        raise _conflict(store, job, ErrorCode.job_not_resumable, "resumed", "paused")


def finish_job(store: Store, job: JobRow, result: ResultReport) -> None:
    """Applies the driver's final word; a no-op for a job that already ended (e.g. cancelled)."""
    if result.status == "succeeded":
        fields = {"fine_tuned_model": result.fine_tuned_model, "result_files": result.result_files,
                  "estimated_finish": None}
        if result.trained_tokens is not None:
            fields["trained_tokens"] = result.trained_tokens
        store.transition(job.id, ACTIVE_STATUSES, JobStatus.succeeded, "Job succeeded", **fields)
    elif result.status == "paused":
        store.transition(job.id, SLOT_STATUSES, JobStatus.paused,
                         "Job paused: its workers checkpointed and released their resources", estimated_finish=None)
    else:
        error = result.error or ErrorInfo(code=ErrorCode.training_failed, message="the training run failed without a reason")
        store.transition(job.id, ACTIVE_STATUSES, JobStatus.failed, f"Job failed: {error.message}", level="error",
                         error=error.model_dump(), estimated_finish=None)
