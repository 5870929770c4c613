"""The internal report route: per-job tokens; events, progress, checkpoints and results reach the job."""

import json
import time

import boto3
import pytest

from moetune.api.layout import CHECKPOINT_MANIFEST
from moetune.api.models.job_run import REPORT_PATH
from moetune.service.local import embedded

JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture
def running(service):
    job_id = service.create_job()["id"]
    return job_id, service.start_job(job_id)


def test_a_wrong_or_missing_job_token_is_401(service, running):
    job_id, token = running
    other_id = service.create_job()["id"]
    other_token = service.start_job(other_id)
    event = {"kind": "event", "message": "hello"}

    assert service.report(job_id, "not-the-token", event).status_code == 401
    assert service.report(job_id, other_token, event).status_code == 401  # tokens are per job
    assert service.report("ftjob-unknown", token, event).status_code == 401
    missing = service.http(None).post(REPORT_PATH.format(job_id=job_id), json={"report": event})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_job_token"
    assert service.report(job_id, token, event).status_code == 200


def test_metrics_events_update_progress_and_eta(service, running):
    job_id, token = running
    first_report = time.time()
    data = {"step": 5, "total_steps": 20, "train_loss": 2.5, "tokens_per_second": 900.0, "trained_tokens": 4096}
    reply = service.report(job_id, token, {"kind": "event", "type": "metrics", "message": "Step 5", "data": data})
    assert reply.json() == {"control": None}
    service.report(job_id, token, {"kind": "event", "type": "metrics", "message": "eval",
                                   "data": {"step": 5, "valid_loss": 2.7}})

    job = service.http().get(f"{JOBS}/{job_id}").json()
    assert job["progress"] == {"step": 5, "total_steps": 20, "train_loss": 2.5, "valid_loss": 2.7,
                               "tokens_per_second": 900.0}
    assert job["trained_tokens"] == 4096
    assert job["estimated_finish"] is None  # one step says nothing of the time per step
    last = service.http().get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"][1]  # newest first
    assert last["type"] == "metrics" and last["data"]["train_loss"] == 2.5

    # The time per step is measured from the first reported step: 15 minutes of start-up before it (Ray, weights,
    # compilation) do not make the remaining 14 steps take 30 minutes.
    service.store.update_job(job_id, started_at=time.time() - 900)
    service.report(job_id, token, {"kind": "event", "type": "metrics", "message": "Step 6", "data": {"step": 6}})
    eta = service.http().get(f"{JOBS}/{job_id}").json()["estimated_finish"]
    assert first_report - 1 <= eta <= time.time() + 14 * (time.time() - first_report) + 2


def test_malformed_metrics_are_rejected(service, running):
    job_id, token = running
    reply = service.report(job_id, token, {"kind": "event", "type": "metrics", "message": "x",
                                           "data": {"step": "seven"}})
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "report.data"
    assert service.http().get(f"{JOBS}/{job_id}").json()["progress"]["step"] == 0


def test_checkpoints_are_listed_newest_first(service, running):
    job_id, token = running
    for step in (10, 20, 30):
        assert service.report_checkpoint(job_id, token, step, train_loss=1.0 / step).status_code == 200
    http = service.http()
    page = http.get(f"{JOBS}/{job_id}/checkpoints", params={"limit": 2}).json()
    assert [c["step_number"] for c in page["data"]] == [30, 20] and page["has_more"]
    assert page["data"][0]["fine_tuned_model_checkpoint"] == service.checkpoint_uri(job_id, 30)
    assert page["data"][0]["fine_tuning_job_id"] == job_id
    rest = http.get(f"{JOBS}/{job_id}/checkpoints", params={"after": page["last_id"]}).json()
    assert [c["step_number"] for c in rest["data"]] == [10] and not rest["has_more"]
    messages = [e["message"] for e in http.get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"]]
    assert f"Checkpoint saved at step 20: {service.checkpoint_uri(job_id, 20)}" in messages


def test_retired_checkpoints_leave_the_list_with_the_report_that_replaces_them(service, running):
    job_id, token = running
    for step in (10, 20):
        assert service.report_checkpoint(job_id, token, step).status_code == 200
    assert service.report_checkpoint(job_id, token, 30, retired_steps=[10, 5]).status_code == 200  # 5: never listed
    http = service.http()
    assert [c["step_number"] for c in http.get(f"{JOBS}/{job_id}/checkpoints").json()["data"]] == [30, 20]
    events = http.get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"]
    (saved,) = [e for e in events if e["message"].startswith("Checkpoint saved at step 30")]
    assert saved["message"].endswith("; retired step-10; retired step-5") and saved["data"]["retired_steps"] == [10, 5]

    reply = service.report_checkpoint(job_id, token, 40, retired_steps=[40])
    assert reply.status_code == 422 and reply.json()["error"]["param"] == "report.checkpoint.retired_steps"
    assert [c["step_number"] for c in http.get(f"{JOBS}/{job_id}/checkpoints").json()["data"]] == [30, 20]


def test_only_complete_checkpoints_of_the_job_are_listed(service, running):
    job_id, token = running
    partial = {"kind": "checkpoint", "step_number": 5, "uri": service.checkpoint_uri(job_id, 5),
               "metrics": {"step": 5}}
    reply = service.report(job_id, token, partial)  # no manifest written: upload not finished
    assert reply.status_code == 409 and reply.json()["error"]["code"] == "checkpoint_incomplete"
    bucket, _, key = f"{partial['uri']}/{CHECKPOINT_MANIFEST}".removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=service.app.state.settings.s3_endpoint_url)
    s3.put_object(Bucket=bucket, Key=key, Body=b"not json")  # storage answers, with what no writer of ours makes
    garbled = service.report(job_id, token, partial)
    assert garbled.status_code == 409 and garbled.json()["error"]["code"] == "checkpoint_incomplete", garbled.text
    elsewhere = service.report(job_id, token, {**partial, "uri": "s3://other-bucket/step-5"})
    assert elsewhere.status_code == 422 and elsewhere.json()["error"]["param"] == "report.uri"
    assert service.http().get(f"{JOBS}/{job_id}/checkpoints").json()["data"] == []


def test_a_checkpoint_reported_while_storage_is_unreachable_is_retried_not_refused(service, running):
    """A worker drops a report refused with a 4xx for good: storage that does not answer (here a closed port) must
    get a 503, which it retries, so the checkpoint is listed once storage is back."""
    job_id, token = running
    settings = service.app.state.settings
    assert service.report_checkpoint(job_id, token, 5).status_code == 200  # writes step 5's manifest too
    report = {"kind": "checkpoint", "step_number": 10, "uri": service.checkpoint_uri(job_id, 10),
              "metrics": {"step": 10}}
    manifest = f"{service.checkpoint_uri(job_id, 10)}/{CHECKPOINT_MANIFEST}".removeprefix("s3://")
    bucket, _, key = manifest.partition("/")
    boto3.client("s3", endpoint_url=settings.s3_endpoint_url).put_object(Bucket=bucket, Key=key,
                                                                         Body=json.dumps({"step": 10}))
    service.app.state.settings = settings.model_copy(update={"s3_endpoint_url":
                                                            f"http://127.0.0.1:{embedded.free_port()}"})
    try:
        reply = service.report(job_id, token, report)
    finally:
        service.app.state.settings = settings
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "storage_unavailable", reply.text
    assert service.report(job_id, token, report).status_code == 200
    listed = service.http().get(f"{JOBS}/{job_id}/checkpoints").json()["data"]
    assert [c["step_number"] for c in listed] == [10, 5]


def test_a_success_result_finishes_the_job(service, running):
    job_id, token = running
    result = {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/adapter",
              "result_files": ["s3://o/metrics.jsonl"], "trained_tokens": 12345}
    assert service.report(job_id, token, result).json() == {"control": None}

    job = service.http().get(f"{JOBS}/{job_id}").json()
    assert job["status"] == "succeeded" and job["fine_tuned_model_uri"] == "s3://o/adapter"
    assert job["fine_tuned_model"] == f"ft:tiny:tenant-a:{job_id}"  # the base's name derived from s3://models/tiny
    assert job["result_files"] == ["s3://o/metrics.jsonl"] and job["trained_tokens"] == 12345
    assert job["finished_at"] is not None and job["error"] is None


def test_a_failure_result_carries_the_error(service, running):
    job_id, token = running
    error = {"code": "invalid_training_file", "message": "row 3 of train.jsonl is not JSON", "param": "training_file"}
    service.report(job_id, token, {"kind": "result", "status": "failed", "error": error})

    job = service.http().get(f"{JOBS}/{job_id}").json()
    assert job["status"] == "failed" and job["error"] == error
    last = service.http().get(f"{JOBS}/{job_id}/events", params={"limit": 100}).json()["data"][0]
    assert last["level"] == "error" and last["message"] == "Job failed: row 3 of train.jsonl is not JSON"


@pytest.mark.parametrize("end", ["cancelled", "failed"])
def test_reports_after_the_job_ended_are_refused_and_change_nothing(service, running, end):
    """Workers still stepping after a cancel, or training on after the job was marked failed (a lost Ray job whose
    orphaned head goes on): a 409 for every kind of report, and nothing of them in the job or its history."""
    job_id, token = running
    if end == "cancelled":
        assert service.http().post(f"{JOBS}/{job_id}/cancel").json()["status"] == "cancelled"
        last = "Job cancelled"
    else:
        error = {"code": "ray_job_lost", "message": "Ray no longer knows the job"}
        assert service.report(job_id, token, {"kind": "result", "status": "failed", "error": error}).status_code == 200
        last = "Job failed: Ray no longer knows the job"

    late = [{"kind": "event", "type": "metrics", "message": "Step 9", "data": {"step": 9}},
            {"kind": "event", "message": "Training finished"},
            {"kind": "checkpoint", "step_number": 9, "uri": "s3://o/ckpt", "metrics": {"step": 9}},
            {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/adapter"}]
    for report in late:
        reply = service.report(job_id, token, report)
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "job_ended", reply.text
        assert f"already {end}" in reply.json()["error"]["message"]

    job = service.http().get(f"{JOBS}/{job_id}").json()
    assert job["status"] == end and job["fine_tuned_model"] is None and job["progress"]["step"] == 0
    assert service.http().get(f"{JOBS}/{job_id}/checkpoints").json()["data"] == []
    newest = service.http().get(f"{JOBS}/{job_id}/events").json()["data"][0]
    assert newest["message"] == last
