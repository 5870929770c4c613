"""Pause and resume: the API's transitions, the report ack that asks workers to pause, and the paused result."""

from moetune.api.client import APIError

JOBS = "/v1/fine_tuning/jobs"


def _status(service, job_id: str) -> str:
    return service.http().get(f"{JOBS}/{job_id}").json()["status"]


def _metrics(step: int) -> dict:
    return {"kind": "event", "type": "metrics", "message": f"Step {step}", "data": {"step": step}}


def test_a_running_job_pauses_through_the_report_ack_and_resumes_as_a_new_attempt(service):
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)
    sdk = service.sdk()
    assert service.report(job_id, token, _metrics(1)).json() == {"control": None}

    assert sdk.jobs.pause(job_id).status == "pausing"
    # Every report the workers send while the job is pausing is answered with the request to pause.
    assert service.report(job_id, token, _metrics(2)).json() == {"control": "pause"}
    assert service.report(job_id, token, {"kind": "result", "status": "paused"}).json() == {"control": None}
    assert _status(service, job_id) == "paused"

    job = sdk.jobs.resume(job_id)
    assert job.status == "queued" and job.progress.step == 2  # progress is kept for the next attempt
    row = service.store.get_job(job_id)
    assert row.attempt == 2 and not row.cancel_requested
    messages = [e.message for e in sdk.jobs.events_since(job_id)]
    assert [m.split(":")[0] for m in messages[-4:]] == ["Pause requested", "Step 2", "Job paused", "Job resumed"]


def test_jobs_waiting_for_a_slot_pause_at_once(service):
    validating = service.create_job()["id"]
    assert service.sdk().jobs.pause(validating).status == "paused"
    assert service.store.get_job(validating).attempt == 1  # never submitted: the attempt is not used up
    assert service.sdk().jobs.cancel(validating).status == "cancelled"  # a paused job can still be cancelled


def test_invalid_transitions_are_409_with_the_reason(service):
    sdk = service.sdk()
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)

    def error_of(call) -> APIError:
        try:
            call(job_id)
        except APIError as e:
            return e
        raise AssertionError("expected a 409")

    e = error_of(sdk.jobs.resume)
    assert (e.status_code, e.code) == (409, "job_not_resumable")
    assert e.message == f"Job {job_id} is running: only paused jobs can be resumed."
    sdk.jobs.pause(job_id)
    assert error_of(sdk.jobs.pause).message == (
        f"Job {job_id} is pausing: only validating_files, queued or running jobs can be paused.")
    service.report(job_id, token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/a"})
    assert _status(service, job_id) == "succeeded"  # the run ended before it reached a step end
    assert error_of(sdk.jobs.pause).code == "job_not_pausable"
    assert error_of(sdk.jobs.resume).code == "job_not_resumable"
    assert error_of(sdk.jobs.cancel).code == "job_not_cancellable"

