"""`moetune server` processes: one (`spawn_control_plane`), or replicas sharing one PostgreSQL database and one
recording Ray Jobs API (`replica_set`, bench.support.ray_jobs_api), of which exactly one schedules. `takeover` stops
the leader mid-queue while a client keeps calling the standby, and times how long the standby takes to lead.
tests/service/test_replicas.py and bench/cluster_faults.py run it."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import httpx

from bench.support.ray_jobs_api import RayJobsAPI
from bench.support.waiting import wait_for
from moetune.service.cluster.scheduler import submission_id
from moetune.service.local.embedded import free_port, s3_env, stop_process, wait_http

JOBS = "/v1/fine_tuning/jobs"
LEASE_S, RENEW_S = 3.0, 0.5  # the scheduler lease and its renewal: a dead leader's lease lapses within LEASE_S


def spawn_control_plane(env: dict[str, str], port: int, log_path: Path) -> subprocess.Popen:
    """A `moetune server` process (own process group), ready to serve; its output is appended to `log_path`."""
    moetune = Path(sys.executable).with_name("moetune")
    with open(log_path, "a") as log:
        proc = subprocess.Popen([str(moetune), "server", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/readyz", 60, proc, str(log_path))
    return proc


def stub_inputs(s3_endpoint: str, bucket: str) -> dict[str, str]:
    """A model folder and training/validation files in `bucket` (placeholders: submission checks that they exist);
    their URIs, as a job create request's fields."""
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for key in ("model/tokenizer.json", "train.jsonl", "valid.jsonl"):
        s3.put_object(Bucket=bucket, Key=key, Body=b"{}")
    s3.put_object(Bucket=bucket, Key="model/config.json", Body=b'{"model_type": "kimi_linear"}')
    return {"model": f"s3://{bucket}/model", "training_file": f"s3://{bucket}/train.jsonl",
            "validation_file": f"s3://{bucket}/valid.jsonl"}


class Replica:
    def __init__(self, env: dict[str, str], log_path, token: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn_control_plane({**env, "MOETUNE_CALLBACK_URL": self.url}, self.port, log_path)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)

    def leads(self) -> bool:
        return "moetune_scheduler_leader 1.0" in self.http.get("/metrics").text

    def create_job(self, inputs: dict) -> str:
        response = self.http.post(JOBS, json=inputs)
        assert response.status_code == 200, response.text
        return response.json()["id"]

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.proc.pid, sig)


class ServiceAddress:
    """One address in front of the replicas, as a Kubernetes Service is: a request goes to the first replica that
    accepts its connection (a killed one refuses it), so what calls this address follows the live replicas. A
    connection lost mid-request is cut here too: the request may have run, and only its sender can tell."""

    _HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        address = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._relay()

            def do_POST(self):
                self._relay()

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ServiceAddress._HOP}
                for replica in address.replicas:
                    try:
                        answer = httpx.request(self.command, replica.url + self.path, content=body, headers=headers,
                                               timeout=30)
                    except httpx.ConnectError:
                        continue
                    except httpx.HTTPError:
                        break
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in ServiceAddress._HOP:
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(answer.content)))
                    self.end_headers()
                    self.wfile.write(answer.content)
                    return
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def replica_set(database_url: str, s3_endpoint: str, output_uri: str, api_tokens: str, token: str,
                log_dir: Path) -> Iterator[tuple[Callable[[], Replica], RayJobsAPI]]:
    """Yields a function that starts a replica (the API with `token`, a tenant's of `api_tokens`, its log in
    `log_dir`) on `database_url`, and the one (slow: 0.2 s a submission) Ray Jobs API they all submit to; stops
    them all."""
    ray_api = RayJobsAPI(submit_delay_s=0.2)
    env = {**os.environ, **s3_env(s3_endpoint), "MOETUNE_DATABASE_URL": database_url,
           "MOETUNE_API_TOKENS": api_tokens, "MOETUNE_RAY_ADDRESS": ray_api.url,
           "MOETUNE_DEFAULT_OUTPUT_URI": output_uri, "MOETUNE_MAX_RUNNING_JOBS": "100",
           "MOETUNE_SCHEDULER_INTERVAL_S": "0.2", "MOETUNE_SCHEDULER_LEASE_S": str(LEASE_S),
           "MOETUNE_SCHEDULER_LEASE_RENEW_S": str(RENEW_S)}
    started: list[Replica] = []

    def start() -> Replica:
        started.append(Replica(env, Path(log_dir) / f"replica-{len(started)}.log", token))
        return started[-1]

    try:
        yield start, ray_api
    finally:
        for replica in started:
            replica.signal(signal.SIGCONT)  # a paused one could not stop
            stop_process(replica.proc)
        ray_api.close()


def hammer(replica: Replica, inputs: dict, answers: list, created: list, stop: threading.Event) -> None:
    """API calls to `replica` until `stop`: lists, reads and a create every fourth call."""
    for n in itertools.count():
        if stop.is_set():
            return
        if n % 4 == 3:
            response = replica.http.post(JOBS, json=inputs)
            if response.status_code == 200:
                created.append(response.json()["id"])
        else:
            response = replica.http.get(JOBS, params={"limit": 5})
        answers.append((response.status_code, response.headers.get("Retry-After")))
        time.sleep(0.05)


def all_running(replica: Replica, job_ids: list[str]) -> bool:
    page = replica.http.get(JOBS, params={"limit": 100}).json()["data"]
    return {j["id"]: j["status"] for j in page if j["id"] in job_ids} == {job_id: "running" for job_id in job_ids}


def takeover(ray_api: RayJobsAPI, old: Replica, sig: signal.Signals, new: Replica, jobs: list[str], inputs: dict,
             answers: list) -> float:
    """Sends `sig` to the leader `old` once it submitted one of `jobs` (mid-queue) while a client keeps calling
    `new` (the jobs it creates are added to `jobs`, its answers' status and Retry-After to `answers`); the seconds
    until `new` leads."""
    wait_for(lambda: any(ray_api.submitters(submission_id(j, 1)) for j in jobs), 30, "the leader to start on the "
             "queue", interval=0.05)
    stop = threading.Event()
    calls = threading.Thread(target=hammer, args=(new, inputs, answers, jobs, stop))
    calls.start()
    old.signal(sig)
    signalled_at = time.monotonic()
    try:
        wait_for(new.leads, 15, "the standby to take the lease", interval=0.1)
        return time.monotonic() - signalled_at
    finally:
        time.sleep(0.3)  # calls to the new leader, too
        stop.set()
        calls.join()
