"""Fixtures of the worker tests: the tiny checkpoint on disk and a loopback receiver of worker reports."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from api.models import WorkerReport

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from workers.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-model")), seed=0)


class ReportReceiver:
    """Records WorkerReports posted to it; answers 503 to the first `fail_first` posts."""

    def __init__(self):
        self.reports: list[WorkerReport] = []
        self.requests: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.fail_first = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append((self.path, self.headers.get("Authorization")))
                if receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    self.send_response(503)
                else:
                    receiver.reports.append(WorkerReport.model_validate(json.loads(body)))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

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
