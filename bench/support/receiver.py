"""A receiver of worker reports (on loopback unless told): what the control plane's report endpoint is to a
Reporter."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from moetune.api.models.job_run import ReportAck, WorkerReport


class ReportReceiver:
    """Records WorkerReports posted to it; answers 503 to the first `fail_first` posts, and every other post
    with a ReportAck whose control is `control_for(report)` (None unless a test replaces it)."""

    def __init__(self, host: str = "127.0.0.1"):
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

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_kind(self, kind: str) -> list:
        return [r.report for r in self.reports if r.report.kind == kind]

    def metrics(self) -> list[dict]:
        return [e.data for e in self.of_kind("event") if e.type == "metrics"]

    def metric_runs(self) -> list[list[dict]]:
        """The reported step metrics, cut where a restarted worker group starts again at its checkpoint."""
        runs: list[list[dict]] = []
        for m in self.metrics():
            if not runs or m["step"] <= runs[-1][-1]["step"]:
                runs.append([])
            runs[-1].append(m)
        return runs

    def repeated_steps(self) -> list[tuple[dict, dict]]:
        """(first, again) for each step a restarted group ran again after its checkpoint: an exact resume gives
        both the same loss."""
        runs = self.metric_runs()
        return [(once, again) for earlier, later in zip(runs, runs[1:])
                for once in earlier for again in later if again["step"] == once["step"]]
