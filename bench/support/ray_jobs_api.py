"""A loopback stand-in for the Ray Jobs REST API (the calls ray.job_submission.JobSubmissionClient makes) that
records every submission attempt: the replica tests (tests/service/test_replicas.py) and bench/cluster_faults.py count
submissions per job without starting Ray jobs.

Like Ray it refuses a submission id it already has; its jobs stay RUNNING (a stop is only recorded) unless a test
ends one (`end`: a driver that died); it has no /api/cluster_status (the scheduler then leaves placement to Ray)
unless a test sets the nodes it reports (`usage_by_node`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import ray
from ray.dashboard.modules.job.common import JOB_ACTOR_NAME_TEMPLATE

from moetune.api.environment import ENV_CALLBACK_URL

_JOB_PATH = re.compile(r"^/api/jobs/([^/]+)$")
_STOP_PATH = re.compile(r"^/api/jobs/([^/]+)/stop$")


class RayJobsAPI:
    def __init__(self, submit_delay_s: float = 0.0, port: int = 0):
        self.attempts: list[tuple[str, str]] = []  # (submission id, the submitting replica's callback URL)
        self.entrypoints: dict[str, str] = {}
        self.env_vars: dict[str, dict[str, str]] = {}  # each submission's environment (its token, its run spec)
        self.ended: dict[str, tuple[str, str | None]] = {}  # submission id -> the status and error type it ended with
        self.stopped: list[str] = []  # submission ids asked to stop
        self.dead_supervisors: set[str] = set()  # supervisor actor names the state API reports DEAD
        self.actor_lists = 0  # state-API actor listings asked for
        # what /api/cluster_status reports per node ({node id: {resource: [used, total]}}); None: no such endpoint
        self.usage_by_node: dict[str, dict[str, list[float]]] | None = None
        self.submit_delay_s = submit_delay_s  # a slow head: a leader killed mid-queue is killed mid-submission
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlsplit(self.path)
                if url.path == "/api/v0/actors":  # the state API, asked for the job supervisor actors
                    query = parse_qs(url.query)
                    listed = [actor for actor in api.supervisors() if all(
                        (actor.get(key) == value) == (predicate == "=") for key, predicate, value in
                        zip(query["filter_keys"], query["filter_predicates"], query["filter_values"]))]
                    with api._lock:
                        api.actor_lists += 1
                    self._answer(200, {"result": True, "data": {"result": {
                        "total": len(listed), "num_after_truncation": len(listed), "num_filtered": len(listed),
                        "result": listed}}})
                elif self.path == "/api/cluster_status" and api.usage_by_node is not None:
                    report = {"loadMetricsReport": {"usageByNode": api.usage_by_node}}
                    self._answer(200, {"result": True, "data": {"clusterStatus": report}})
                elif self.path == "/api/version":
                    self._answer(200, {"version": "4", "ray_version": ray.__version__})
                elif (match := _JOB_PATH.match(self.path)) and match[1] in api.entrypoints:
                    status, error_type = api.ended.get(match[1], ("RUNNING", None))
                    self._answer(200, {"type": "SUBMISSION", "submission_id": match[1], "status": status,
                                       "error_type": error_type, "entrypoint": api.entrypoints[match[1]]})
                else:
                    self._answer(404, {"detail": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if (match := _STOP_PATH.match(self.path)) and match[1] in api.entrypoints:
                    with api._lock:
                        api.stopped.append(match[1])
                    self._answer(200, {"stopped": True})
                    return
                if self.path != "/api/jobs/":
                    self._answer(404, {"detail": "not found"})
                    return
                sid = body["submission_id"]
                time.sleep(api.submit_delay_s)
                with api._lock:
                    api.attempts.append((sid, body["runtime_env"]["env_vars"][ENV_CALLBACK_URL]))
                    known = sid in api.entrypoints
                    api.entrypoints.setdefault(sid, body["entrypoint"])
                    api.env_vars.setdefault(sid, body["runtime_env"]["env_vars"])
                if known:
                    self._answer(400, {"detail": f"Job with submission_id {sid} already exists."})
                else:
                    self._answer(200, {"submission_id": sid, "job_id": None})

            def _answer(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the replica asking was killed mid-submission, as a takeover test means it to be

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def submitters(self, sid: str) -> list[str]:
        with self._lock:
            return [replica for attempt, replica in self.attempts if attempt == sid]

    def supervisors(self) -> list[dict]:
        """The state API's view of each submission's supervisor actor: DEAD once its job ended or a test killed
        it, else ALIVE."""
        with self._lock:
            names = {sid: JOB_ACTOR_NAME_TEMPLATE.format(job_id=sid) for sid in self.entrypoints}
            return [{"name": name, "class_name": "JobSupervisor",
                     "state": "DEAD" if sid in self.ended or name in self.dead_supervisors else "ALIVE"}
                    for sid, name in names.items()]

    def end(self, sid: str, status: str = "FAILED", error_type: str | None = None) -> None:
        """Ray's JobErrorType value says why it failed (None: the driver's own failure, or no failure)."""
        with self._lock:
            self.ended[sid] = (status, error_type)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
