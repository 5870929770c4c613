"""A real control plane on a loopback port (uvicorn in a background thread) and helpers to drive its jobs."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import boto3
import httpx
import pytest
from fastapi import FastAPI

from moetune.api.client import Client
from moetune.api.models import CHECKPOINT_MANIFEST, CHECKPOINTS_DIR, REPORT_PATH, JobStatus
from moetune.service.app import create_app
from moetune.service.auth import hash_token, new_job_token
from moetune.service.embedded import control_plane_in_thread, free_port
from moetune.service.settings import Settings
from moetune.service.store import Store

TOKENS = {"tenant-a": "tok-a", "tenant-b": "tok-b"}
API_TOKENS = ",".join(f"{token}:{tenant}" for tenant, token in TOKENS.items())
OUTPUT_BUCKET = "outputs"
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
        return f"{self.store.get_job(job_id).output_uri}/{CHECKPOINTS_DIR}/step-{step}"

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
    with control_plane_in_thread(app, free_port()) as url:
        yield RunningService(url=url, app=app)


def settings_for(tmp_dir, **overrides) -> Settings:
    values = {"database_url": f"sqlite:///{tmp_dir}/moetune.db", "api_tokens": API_TOKENS,
              "scheduler_enabled": False, "default_output_uri": f"s3://{OUTPUT_BUCKET}/runs", **overrides}
    return Settings(**values)


@pytest.fixture(scope="module")
def service(tmp_path_factory, s3_endpoint) -> Iterator[RunningService]:
    """One control plane per test module, scheduler off: tests move jobs along themselves. Job outputs go to
    the session's S3 server (the control plane reads checkpoint manifests there)."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if OUTPUT_BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=OUTPUT_BUCKET)
    settings = settings_for(tmp_path_factory.mktemp("service"), s3_endpoint_url=s3_endpoint)
    with run_service(settings) as running:
        yield running


@pytest.fixture
def start_service(tmp_path):
    """Starts a control plane with custom settings; stopped at the end of the test."""
    with ExitStack() as stack:
        yield lambda **overrides: stack.enter_context(run_service(settings_for(tmp_path, **overrides)))


def _postgres_bin() -> str | None:
    found = shutil.which("initdb")
    if found:
        return os.path.dirname(os.path.realpath(found))
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return os.path.dirname(candidates[-1]) if candidates else None


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL server on loopback (initdb + pg_ctl); yields a SQLAlchemy URL prefix without a database.

    PostgreSQL refuses to run as root, so as root the server runs as the `postgres` system user.
    """
    bin_dir = _postgres_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL server binaries are not installed (Debian package postgresql)")
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    root = tempfile.mkdtemp(prefix="moetune-pg-")
    if as_user:
        shutil.chown(root, "postgres")
    data, port = os.path.join(root, "data"), free_port()
    subprocess.run([*as_user, f"{bin_dir}/initdb", "-D", data, "-A", "trust", "-U", "moetune"], check=True,
                   capture_output=True)
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run([*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-o", opts, "-l", f"{root}/log", "-w", "start"],
                   check=True, capture_output=True)
    try:
        yield f"postgresql+psycopg://moetune@127.0.0.1:{port}"
    finally:
        subprocess.run([*as_user, f"{bin_dir}/pg_ctl", "-D", data, "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    from sqlalchemy import create_engine, text

    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(f"{postgres_server}/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"{postgres_server}/{name}"
