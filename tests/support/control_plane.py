"""The control plane for tests: in a background thread of the test process (`run_service`, a RunningService with
helpers to drive its jobs), or as a `moetune server` process wired to the session's Ray head and S3 server
(`control_plane_env`, for bench.support.replicas.spawn_control_plane). Both accept the same two tenants' tokens
(TOKENS)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
from fastapi import FastAPI

from moetune.api.client import Client
from moetune.api.layout import CHECKPOINT_MANIFEST, checkpoint_uri
from moetune.api.models.job_run import REPORT_PATH
from moetune.api.models.responses import JobStatus
from moetune.service.app import create_app
from moetune.service.auth import hash_token, new_job_token
from moetune.service.local.embedded import control_plane_in_thread, listening_socket, s3_env
from moetune.service.settings import Settings
from moetune.service.store import Store

TOKENS = {"tenant-a": "tok-a", "tenant-b": "tok-b"}
API_TOKENS = ",".join(f"{token}:{tenant}" for tenant, token in TOKENS.items())
OUTPUT_BUCKET = "outputs"
ASSETS_BUCKET = "e2e-assets"  # the `moetune server` processes' assets and default outputs
SPEC = {"model": "s3://models/tiny", "training_file": "s3://data/train.jsonl"}


@dataclass
class RunningService:
    url: str
    app: FastAPI

    @property
    def store(self) -> Store:
        return self.app.state.store

    def http(self, tenant: str | None = "tenant-a") -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKENS[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def sdk(self, tenant: str = "tenant-a") -> Client:
        return Client(self.url, TOKENS[tenant], timeout=10)

    def create_job(self, tenant: str = "tenant-a", **fields) -> dict:
        response = self.http(tenant).post("/v1/fine_tuning/jobs", json={**SPEC, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    def start_job(self, job_id: str) -> str:
        """What the scheduler does around a Ray submission, minus Ray; returns the job's worker token."""
        token = new_job_token()
        assert self.store.transition(job_id, [JobStatus.validating_files], JobStatus.queued, "Job queued")
        assert self.store.update_job(job_id, job_token_hash=hash_token(token))
        assert self.store.transition(job_id, [JobStatus.queued], JobStatus.running, "Job started",
                                     ray_submission_id=f"moetune-{job_id}-1")
        return token

    def report(self, job_id: str, token: str, report: dict) -> httpx.Response:
        return httpx.post(self.url + REPORT_PATH.format(job_id=job_id), json={"report": report},
                          headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def checkpoint_uri(self, job_id: str, step: int) -> str:
        return checkpoint_uri(self.store.get_job(job_id).output_uri, step)

    def report_checkpoint(self, job_id: str, token: str, step: int, retired_steps=(), **metrics) -> httpx.Response:
        """What a worker does: the checkpoint's manifest goes to object storage, then the report."""
        uri = self.checkpoint_uri(job_id, step)
        bucket, _, key = uri.removeprefix("s3://").partition("/")
        boto3.client("s3", endpoint_url=self.app.state.settings.s3_endpoint_url).put_object(
            Bucket=bucket, Key=f"{key}/{CHECKPOINT_MANIFEST}", Body=json.dumps({"step": step, "files": []}))
        return self.report(job_id, token, {"kind": "checkpoint", "step_number": step, "uri": uri,
                                           "metrics": {"step": step, **metrics}, "retired_steps": list(retired_steps)})


@contextmanager
def run_service(settings: Settings) -> Iterator[RunningService]:
    app = create_app(settings)
    with control_plane_in_thread(app, listening_socket()) as url:
        yield RunningService(url=url, app=app)


def settings_for(tmp_dir, **overrides) -> Settings:
    values = {"database_url": f"sqlite:///{tmp_dir}/moetune.db", "api_tokens": API_TOKENS,
              "scheduler_enabled": False, "default_output_uri": f"s3://{OUTPUT_BUCKET}/runs", **overrides}
    return Settings(**values)


def control_plane_env(s3_endpoint: str, ray_head, work: Path, port: int) -> dict[str, str]:
    """The environment of a `moetune server` on `port` wired to the session's S3 server and Ray head."""
    return {
        **os.environ,
        **s3_env(s3_endpoint),
        "MOETUNE_DATABASE_URL": f"sqlite:///{work / 'moetune.db'}",
        "MOETUNE_API_TOKENS": API_TOKENS,
        "MOETUNE_RAY_ADDRESS": ray_head.dashboard_url,
        "MOETUNE_CALLBACK_URL": f"http://127.0.0.1:{port}",
        "MOETUNE_DEFAULT_OUTPUT_URI": f"s3://{ASSETS_BUCKET}/outputs",
        "MOETUNE_SCHEDULER_INTERVAL_S": "0.5",
        # a restarted process (a new lease holder) schedules once the killed one's lease ran out: 3 s, not 10
        "MOETUNE_SCHEDULER_LEASE_S": "3",
        "MOETUNE_SCHEDULER_LEASE_RENEW_S": "1",
    }

