"""Shared real parts for the suite: one local S3 server and one local Ray head per session, and a
loopback receiver of worker reports."""

from __future__ import annotations

import json
import os
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest

from moetune.api.models import ReportAck, WorkerReport
from moetune.service.embedded import local_ray_head, local_s3_server, s3_env


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a real S3-compatible server (moto) on loopback; AWS_* and MOETUNE_S3_ENDPOINT_URL are set."""
    with local_s3_server() as url:
        env = s3_env(url)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        yield url
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket name on the session's S3 server."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def ray_head(s3_endpoint):
    """A real local Ray head (Jobs API at .dashboard_url, GCS at .gcs_address) that sees the S3 server."""
    with local_ray_head(num_cpus=4, env=s3_env(s3_endpoint)) as head:
        yield head


class ReportReceiver:
    """Records WorkerReports posted to it; answers 503 to the first `fail_first` posts, and every other post
    with a ReportAck whose control is `control_for(report)` (None unless a test replaces it)."""

    def __init__(self):
        self.reports: list[WorkerReport] = []
        self.requests: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.fail_first = 0
        self.control_for = lambda report: None
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, self.headers.get("Authorization")))
                answer = b""
                if receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    self.send_response(503)
                else:
                    report = WorkerReport.model_validate(json.loads(body))
                    receiver.reports.append(report)
                    answer = ReportAck(control=receiver.control_for(report)).model_dump_json().encode()
                    self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_kind(self, kind: str) -> list:
        return [r.report for r in self.reports if r.report.kind == kind]

    def metrics(self) -> list[dict]:
        return [e.data for e in self.of_kind("event") if e.type == "metrics"]


@pytest.fixture
def receiver():
    r = ReportReceiver()
    yield r
    r.server.shutdown()
    r.server.server_close()
