"""A real control plane on a loopback port (uvicorn in a background thread; tests.support.control_plane) per test
module or per test, and a real PostgreSQL server."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack

import boto3
import pytest

from moetune.service.local.embedded import free_port
from tests.support.control_plane import OUTPUT_BUCKET, RunningService, run_service, settings_for


@pytest.fixture(scope="session")
def output_bucket(s3_endpoint) -> str:
    """The default output location's bucket in the session's S3 server (submission checks it is writable)."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    if OUTPUT_BUCKET not in [b["Name"] for b in s3.list_buckets()["Buckets"]]:
        s3.create_bucket(Bucket=OUTPUT_BUCKET)
    return OUTPUT_BUCKET


@pytest.fixture
def inputs(s3_endpoint, s3_bucket, output_bucket):
    """URIs of a model folder and training/validation files that exist in a real bucket."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in ("model/tokenizer.json", "train.jsonl", "valid.jsonl"):
        s3.put_object(Bucket=s3_bucket, Key=key, Body=b"{}")
    s3.put_object(Bucket=s3_bucket, Key="model/config.json", Body=b'{"model_type": "kimi_linear"}')
    return {"model": f"s3://{s3_bucket}/model", "training_file": f"s3://{s3_bucket}/train.jsonl",
            "validation_file": f"s3://{s3_bucket}/valid.jsonl"}


@pytest.fixture(scope="module")
def service(tmp_path_factory, s3_endpoint, output_bucket) -> Iterator[RunningService]:
    """One control plane per test module, scheduler off: tests move jobs along themselves. Job outputs go to
    the session's S3 server (the control plane reads checkpoint manifests there)."""
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
