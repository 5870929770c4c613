"""A real control plane (the `moetune server` console script) wired to the session's Ray head and S3 server."""

from __future__ import annotations

import boto3
import pytest

from bench.support.replicas import spawn_control_plane
from moetune.api.client import Client
from moetune.service.local.embedded import free_port, stop_process
from tests.support.control_plane import ASSETS_BUCKET, TOKENS, control_plane_env


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


@pytest.fixture(scope="session")
def control_plane(s3_endpoint, ray_head, serve_url, tmp_path_factory):
    """Base URL of a `moetune server` process; its output goes to a log file shown on failure."""
    port = free_port()
    work = tmp_path_factory.mktemp("control-plane")
    env = {**control_plane_env(s3_endpoint, ray_head, work, port),
           "MOETUNE_SERVE_URL": serve_url,  # a session's weights deploy there
           # tests delete the Serve app behind its back, and tests/e2e/test_serve.py's own control plane deploys on
           # the same Ray head: this one must not bring its deployments back
           "MOETUNE_RESTORE_DEPLOYMENTS": "false"}
    proc = spawn_control_plane(env, port, work / "server.log")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


@pytest.fixture
def client_a(control_plane):
    return Client(control_plane, TOKENS["tenant-a"])
