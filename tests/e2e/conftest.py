"""A real control plane (the `moetune server` console script) wired to the session's Ray head and S3 server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest

from moetune.api.client import Client
from moetune.service.embedded import free_port, s3_env, stop_process, wait_http

TENANT_TOKENS = {"tenant-a": "tok-a", "tenant-b": "tok-b"}
ASSETS_BUCKET = "e2e-assets"


@pytest.fixture(scope="session")
def tiny_assets(s3_endpoint, tmp_path_factory):
    """URIs of a tiny kimi_linear checkpoint and datasets in the S3 server, plus the local checkpoint dir."""
    from moetune.workers.tiny import write_tiny_checkpoint, write_tiny_dataset

    work = tmp_path_factory.mktemp("assets")
    write_tiny_checkpoint(work / "model", seed=0)
    write_tiny_dataset(work / "train.jsonl", n_rows=128, seed=1)
    write_tiny_dataset(work / "valid.jsonl", n_rows=16, seed=2)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    s3.create_bucket(Bucket=ASSETS_BUCKET)
    for path in (work / "model").iterdir():
        s3.upload_file(str(path), ASSETS_BUCKET, f"model/{path.name}")
    for name in ("train.jsonl", "valid.jsonl"):
        s3.upload_file(str(work / name), ASSETS_BUCKET, name)
    return {
        "model": f"s3://{ASSETS_BUCKET}/model",
        "training_file": f"s3://{ASSETS_BUCKET}/train.jsonl",
        "validation_file": f"s3://{ASSETS_BUCKET}/valid.jsonl",
        "local_model": work / "model",
        "local_train": work / "train.jsonl",
    }


def control_plane_env(s3_endpoint: str, ray_head, work: Path, port: int) -> dict[str, str]:
    return {
        **os.environ,
        **s3_env(s3_endpoint),
        "MOETUNE_DATABASE_URL": f"sqlite:///{work / 'moetune.db'}",
        "MOETUNE_API_TOKENS": ",".join(f"{tok}:{tenant}" for tenant, tok in TENANT_TOKENS.items()),
        "MOETUNE_RAY_ADDRESS": ray_head.dashboard_url,
        "MOETUNE_CALLBACK_URL": f"http://127.0.0.1:{port}",
        "MOETUNE_DEFAULT_OUTPUT_URI": f"s3://{ASSETS_BUCKET}/outputs",
        "MOETUNE_SCHEDULER_INTERVAL_S": "0.5",
    }


def spawn_control_plane(env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen:
    """A `moetune server` process (own process group), ready to serve; its output is appended to `log_path`."""
    moetune = Path(sys.executable).with_name("moetune")
    with open(log_path, "a") as log:
        proc = subprocess.Popen([str(moetune), "server", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc, str(log_path))
    return proc


@pytest.fixture(scope="session")
def control_plane(s3_endpoint, ray_head, tmp_path_factory):
    """Base URL of a `moetune server` process; its output goes to a log file shown on failure."""
    port = free_port()
    work = tmp_path_factory.mktemp("control-plane")
    proc = spawn_control_plane(control_plane_env(s3_endpoint, ray_head, work, port), port, work / "server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def client_a(control_plane):
    return Client(control_plane, TENANT_TOKENS["tenant-a"])
