"""The embedded default stack, all on loopback: an S3-compatible server and a local Ray head.

Used by `moetune demo` and by the test suite, so both exercise the same real parts. Each
helper owns the processes it starts (own process group) and stops only those.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx

LOCAL_S3_KEY = "moetune-local"  # credentials of the embedded S3 server (any value works there)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log_path: str | None = None) -> None:
    """Polls `url` until it answers; fails early (with the log's tail) if `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with code {proc.returncode} before {url} answered"
                               + _log_tail(log_path))
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s" + _log_tail(log_path))


def _log_tail(log_path: str | None, lines: int = 20) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        return "; its output ended with:\n" + "".join(f.readlines()[-lines:])


def _spawn(args: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a helper server in its own process group (so stop_process ends all of it), output to a log."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def s3_env(endpoint_url: str) -> dict[str, str]:
    """Environment that points boto3/s3fs (and moetune's workers) at the embedded server."""
    return {
        "MOETUNE_S3_ENDPOINT_URL": endpoint_url,
        "AWS_ACCESS_KEY_ID": LOCAL_S3_KEY,
        "AWS_SECRET_ACCESS_KEY": LOCAL_S3_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def spawn_s3_server(port: int, log_path: str, data_dir: str | None = None,
                    env: dict[str, str] | None = None, host: str = "127.0.0.1") -> subprocess.Popen:
    """The S3 server (s3_server.py) on `host`:`port` (own process group), serving when this returns; its objects
    in memory, or durable in `data_dir`."""
    args = [sys.executable, "-m", "moetune.service.local.s3_server", "--port", str(port), "--host", host]
    proc = _spawn(args + (["--data-dir", data_dir] if data_dir else []), log_path, env=env)
    try:
        wait_http(f"http://{host}:{port}/", 60, proc, log_path)
    except BaseException:
        stop_process(proc)
        raise
    return proc


@contextmanager
def local_s3_server(port: int | None = None, host: str = "127.0.0.1"):
    """An in-memory S3 server over HTTP on `host` (loopback unless told); yields its endpoint URL."""
    port = port or free_port()
    log_dir = tempfile.mkdtemp(prefix="moetune-s3-")
    proc = spawn_s3_server(port, os.path.join(log_dir, "server.log"), host=host)
    try:
        yield f"http://{host}:{port}"
    finally:
        stop_process(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


RAY_PORTS = ("gcs", "dashboard", "agent", "client")
# A head on one machine has no nodes to lose to preemption and its drivers carry their own runtime environments:
# Ray Train's preemption watcher (an actor per run) and the idle workers prestarted for a driver, whose environment
# never matches a job's, each cost a Python process per job (~2.5 s of CPU apiece) and do nothing here. The log
# monitor globs the session's log folder for new files ten times a second until it holds 1,000 (every worker and
# actor leaves two): every 2 s instead, which only delays the first lines of a new worker's log (an idle head:
# 4.05 -> 3.38 CPU-s a minute; the suite's heads spent ~50 CPU-s each in it before).
_ONE_MACHINE = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_prestart_worker_first_driver": "0",
                "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2"}


@dataclass
class RayHead:
    gcs_address: str
    dashboard_url: str  # where the Jobs API listens
    ports: dict[str, int]  # by RAY_PORTS name: what a restarted head takes again


def spawn_ray_head(num_cpus: int, env: dict[str, str] | None, temp_dir: str,
                   ports: dict[str, int] | None = None) -> tuple[subprocess.Popen, RayHead]:
    """`ray start --head --block` in its own process group, its sessions and logs under `temp_dir`; its Jobs API
    answers when this returns.

    `num_cpus` is logical: tiny CPU jobs may oversubscribe the machine's cores. The processes
    inherit `env` (e.g. the S3 endpoint), so Ray jobs and their workers see it too. `ports` (by RAY_PORTS name):
    those to listen on, free ones for the rest.
    """
    ports = {name: (ports or {}).get(name) or free_port() for name in RAY_PORTS}
    gcs_port, dash_port, agent_port, client_port = (ports[name] for name in RAY_PORTS)
    ray_bin = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    log_path = os.path.join(temp_dir, "ray-start.log")
    args = [
        ray_bin, "start", "--head", "--block",
        f"--port={gcs_port}", f"--num-cpus={num_cpus}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash_port}",
        # Fixed defaults (agent 52365, client 10001) would collide with any other Ray on this machine;
        # a head whose agent cannot bind accepts no job ("No available agent to submit job").
        f"--dashboard-agent-listen-port={agent_port}", f"--ray-client-server-port={client_port}",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]
    # Jobs run `python -m moetune.workers.entry.driver`: put this interpreter's bin first so they find our packages.
    path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    # Ray 2.60's `ray start` turns token auth on whenever ~/.ray/auth_token exists (any earlier local ray.init
    # leaves one), while its clients stay in the default mode, "disabled", and are refused: the mode is set here
    # unless the caller chose one, so a leftover file changes nothing.
    env = {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **_ONE_MACHINE, **(env or {})}
    proc = _spawn(args, log_path, env={**os.environ, "PATH": path, **env})
    dashboard_url = f"http://127.0.0.1:{dash_port}"
    try:
        wait_http(f"{dashboard_url}/api/version", 90, proc, log_path)
    except BaseException:
        stop_process(proc, grace=5)
        raise
    return proc, RayHead(gcs_address=f"127.0.0.1:{gcs_port}", dashboard_url=dashboard_url, ports=ports)


@contextmanager
def local_ray_head(num_cpus: int, env: dict[str, str] | None = None):
    """A Ray head (spawn_ray_head) in a temporary directory, stopped and removed on exit."""
    temp_dir = tempfile.mkdtemp(prefix="moetune-ray-")
    try:
        proc, head = spawn_ray_head(num_cpus, env, temp_dir)
    except BaseException:
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    try:
        yield head
    finally:
        stop_process(proc, grace=5)
        shutil.rmtree(temp_dir, ignore_errors=True)


@contextmanager
def control_plane_in_thread(app, port: int, host: str = "127.0.0.1"):
    """Serves the FastAPI app with uvicorn on `host` (loopback unless other machines' workers report to it) from a
    background thread; yields its base URL."""
    import threading

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name="moetune-control-plane", daemon=True)
    thread.start()
    url = f"http://{host}:{port}"
    try:
        wait_http(f"{url}/healthz", 30)
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
