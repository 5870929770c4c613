"""The Python SDK and the official `openai` package against a running control plane."""

import threading

import openai
import pytest

from moetune.api.client import APIError
from moetune.api.models.job_create import JobCreate
from moetune.api.models.responses import JobStatus


def test_sdk_covers_the_job_lifecycle(service):
    client = service.sdk()
    job = client.jobs.create(JobCreate(model="s3://m/tiny", training_file="s3://d/t.jsonl"), idempotency_key="k-1")
    assert client.jobs.create({"model": "s3://m/tiny", "training_file": "s3://d/t.jsonl"},
                              idempotency_key="k-1").id == job.id
    assert client.jobs.retrieve(job.id).status == JobStatus.validating_files
    assert job.id in [j.id for j in client.jobs.list(limit=100).data]

    token = service.start_job(job.id)
    service.report_checkpoint(job.id, token, 4, train_loss=1.5)
    checkpoint = client.jobs.checkpoints(job.id).data[0]
    assert checkpoint.step_number == 4 and checkpoint.metrics.train_loss == 1.5

    page = client.jobs.events(job.id, limit=2)  # newest first, as OpenAI's
    saved = f"Checkpoint saved at step 4: {service.checkpoint_uri(job.id, 4)}"
    assert [e.message for e in page.data] == [saved, "Job started"] and page.has_more
    assert [e.message for e in client.jobs.events(job.id, after=page.last_id).data] == [
        "Job queued", "Validating files", "Job created"]

    assert client.jobs.cancel(job.id).status == JobStatus.cancelled
    with pytest.raises(APIError) as err:
        client.jobs.cancel(job.id)
    assert (err.value.status_code, err.value.code) == (409, "job_not_cancellable")


def test_sdk_errors_carry_code_and_param(service):
    with pytest.raises(APIError) as err:
        service.sdk().jobs.create({"model": "s3://m/x", "training_file": "s3://d/t.jsonl",
                                   "training": {"global_batch_size": 3, "micro_batch_size": 2}})
    assert (err.value.status_code, err.value.code, err.value.param) == (422, "invalid_request",
                                                                        "training.global_batch_size")
    with pytest.raises(APIError) as err:
        service.sdk().jobs.retrieve("ftjob-nope")
    assert (err.value.status_code, err.value.code) == (404, "job_not_found")


def test_sdk_streams_and_waits_until_the_job_ends(service):
    client = service.sdk()
    job = client.jobs.create({"model": "s3://m/tiny", "training_file": "s3://d/t.jsonl"})
    token = service.start_job(job.id)
    streamed, waited = [], []
    stream = threading.Thread(target=lambda: streamed.extend(client.jobs.stream_events(job.id)))
    stream.start()

    service.report(job.id, token, {"kind": "event", "type": "metrics", "message": "Step 1", "data": {"step": 1}})
    service.report(job.id, token, {"kind": "result", "status": "succeeded", "fine_tuned_model": "s3://o/a"})
    final = client.jobs.wait(job.id, timeout=10, poll_interval=0.1, on_event=waited.append)
    stream.join(10)

    assert final.status == JobStatus.succeeded and final.fine_tuned_model_uri == "s3://o/a"
    assert [e.message for e in streamed] == [e.message for e in waited]
    assert [e.message for e in streamed][-2:] == ["Step 1", "Job succeeded"]
    tail = list(client.jobs.stream_events(job.id, after=streamed[-2].id))
    assert [e.message for e in tail] == ["Job succeeded"]


def test_sdk_wait_times_out(service):
    client = service.sdk()
    job = client.jobs.create({"model": "s3://m/tiny", "training_file": "s3://d/t.jsonl"})
    with pytest.raises(TimeoutError):
        client.jobs.wait(job.id, timeout=0.3, poll_interval=0.1)


def test_the_openai_package_can_drive_jobs(service):
    job_id = service.create_job()["id"]
    token = service.start_job(job_id)
    service.report(job_id, token, {"kind": "event", "type": "metrics", "message": "Step 1",
                                   "data": {"step": 1, "train_loss": 2.0}})
    oa = openai.OpenAI(base_url=f"{service.url}/v1", api_key="tok-a", max_retries=0)

    assert job_id in [j.id for j in oa.fine_tuning.jobs.list(limit=100).data]
    job = oa.fine_tuning.jobs.retrieve(job_id)
    assert job.status == "running" and job.hyperparameters.batch_size == 8
    events = oa.fine_tuning.jobs.list_events(job_id).data
    assert "Step 1" in [e.message for e in events]
    assert oa.fine_tuning.jobs.cancel(job_id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=f"{service.url}/v1", api_key="tok-b", max_retries=0).fine_tuning.jobs.retrieve(job_id)
