"""SIGKILL the control plane while jobs are queued and running: after a restart nothing is lost or duplicated,
and every job's state matches Ray's (jobs that ended while it was down get their final state).

The Ray jobs run tests/e2e/restart_driver.py, a real driver process that reports like the training driver
but trains nothing, so five jobs fit on two cores; the fault (a killed control plane) is real.
"""

from __future__ import annotations

import signal
import sys
import time
import uuid
from pathlib import Path

import boto3
import httpx
import pytest
from ray.job_submission import JobSubmissionClient

from bench.support.replicas import spawn_control_plane
from moetune.api.client import Client
from moetune.service.local.embedded import free_port, stop_process
from tests.support.control_plane import TOKENS, control_plane_env

pytestmark = pytest.mark.ray_job
DRIVER = Path(__file__).with_name("restart_driver.py")


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def test_sigkill_restart_loses_and_duplicates_nothing(s3_endpoint, ray_head, s3_bucket, tmp_path):
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in ("model/tokenizer.json", "train.jsonl", "fail-train.jsonl"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=b"{}")
    # what submission reads: a supported model_type and a tokenizer file (the stub driver trains nothing)
    s3.put_object(Bucket=s3_bucket, Key="model/config.json", Body=b'{"model_type": "kimi_linear"}')
    secret = f"secret-{uuid.uuid4().hex}"  # the S3 secret the control plane hands its Ray jobs
    port = free_port()
    env = {**control_plane_env(s3_endpoint, ray_head, tmp_path, port), "AWS_SECRET_ACCESS_KEY": secret,
           "MOETUNE_DEFAULT_OUTPUT_URI": f"s3://{s3_bucket}/outputs", "MOETUNE_MAX_RUNNING_JOBS": "3",
           "MOETUNE_DRIVER_ENTRYPOINT": f"{sys.executable} {DRIVER}", "MOETUNE_SCHEDULER_INTERVAL_S": "0.3"}
    log = tmp_path / "server.log"
    client = Client(f"http://127.0.0.1:{port}", TOKENS["tenant-a"])
    spec = {"model": f"s3://{s3_bucket}/model", "training_file": f"s3://{s3_bucket}/train.jsonl"}

    def go(job_id: str) -> None:
        s3.put_object(Bucket=s3_bucket, Key=f"outputs/{job_id}/go", Body=b"")

    def started(job_id: str) -> int:
        return sum(e.message == "restart driver started" for e in client.jobs.events(job_id, limit=100).data)

    first = spawn_control_plane(env, port, log)
    try:
        ends_ok, ends_failed, lives_on = (client.jobs.create(spec).id, client.jobs.create(
            {**spec, "training_file": f"s3://{s3_bucket}/fail-train.jsonl"}).id, client.jobs.create(spec).id)
        _wait_for(lambda: all(started(j) for j in (ends_ok, ends_failed, lives_on)), 180, "three running drivers")
        queued = [client.jobs.create(spec).id for _ in range(2)]
        _wait_for(lambda: all(client.jobs.retrieve(j).status == "queued" for j in queued), 30, "two queued jobs")
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        stop_process(first)

    # While the control plane is down two jobs end; their drivers give up on their result reports.
    ray = JobSubmissionClient(ray_head.dashboard_url)
    for job_id in (ends_ok, ends_failed, *queued):
        go(job_id)
    _wait_for(lambda: ray.get_job_status(f"moetune-{ends_ok}-1") == "SUCCEEDED"
              and ray.get_job_status(f"moetune-{ends_failed}-1") == "FAILED", 120, "Ray to end two jobs")

    second = spawn_control_plane(env, port, log)
    try:
        ok = client.jobs.wait(ends_ok, timeout=60, poll_interval=0.5)
        assert ok.status == "succeeded" and ok.fine_tuned_model_uri == f"{ok.output_uri}/adapter"
        assert ok.trained_tokens == 42
        failed = client.jobs.wait(ends_failed, timeout=60, poll_interval=0.5)
        assert failed.status == "failed" and failed.error.code == "driver_failed"
        assert "the training file asks this job to fail" in failed.error.message
        assert client.jobs.retrieve(lives_on).status == "running"  # followed again, its token still valid
        go(lives_on)
        for job_id in (lives_on, *queued):
            job = client.jobs.wait(job_id, timeout=180, poll_interval=0.5)
            assert job.status == "succeeded" and job.trained_tokens == 42, job.error

        every = [ends_ok, ends_failed, lives_on, *queued]
        assert sorted(j.id for j in client.jobs.list(limit=100).data) == sorted(every)  # none lost, none extra
        # (the session's head also lists drivers other tests connected with ray.init: they have no submission id)
        submissions = [j.submission_id for j in ray.list_jobs()
                       if any((j.submission_id or "").startswith(f"moetune-{i}") for i in every)]
        assert sorted(submissions) == sorted(f"moetune-{i}-1" for i in every)  # one Ray job per job
        assert [started(j) for j in every] == [1] * 5

        # The secret reached the drivers (they wrote to S3 with it) but no answer, event or log shows it.
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}",
                            headers={"Authorization": f"Bearer {TOKENS['tenant-a']}"})
        seen = [http.get("/v1/fine_tuning/jobs", params={"limit": 100}).text, http.get("/metrics").text]
        seen += [http.get(f"/v1/fine_tuning/jobs/{j}/events", params={"limit": 100}).text for j in every]
        seen += [ray.get_job_logs(f"moetune-{j}-1") for j in every]
        seen.append(log.read_text())
        assert not [text for text in seen if secret in text]
    finally:
        stop_process(second)
        for job_id in (ends_ok, ends_failed, lives_on):  # nothing left waiting on a go marker
            go(job_id)
