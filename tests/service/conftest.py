"""A real control plane on a loopback port (uvicorn in a background thread; tests.support.control_plane) per test
module or per test, and a real PostgreSQL server (bench.support.postgres)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import boto3
import pytest

from bench.support.postgres import fresh_database, postgres_bin, running_postgres
from bench.support.replicas import stub_inputs
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
    return stub_inputs(s3_endpoint, s3_bucket)


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """A real PostgreSQL server on loopback (bench.support.postgres); yields a SQLAlchemy URL prefix without a
    database."""
    if postgres_bin() is None:
        pytest.skip("PostgreSQL server binaries are not installed (Debian package postgresql)")
    with running_postgres() as url:
        yield url


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's PostgreSQL server."""
    return fresh_database(postgres_server)
