"""The embedded default stack, all on loopback: an S3-compatible server and a local Ray head.

Used by `moetune demo` and by the test suite, so both exercise the same real parts. Each
helper owns the processes it starts (own process group) and stops only those.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import httpx

LOCAL_S3_KEY = "moetune-local"  # credentials of the embedded S3 server (any value works there)


# A Ray head by default takes 10001 (its client server) and hands its workers 10002-19999: ports we choose start
# above them.
_FIRST_PORT = 20000
_LINUX_EPHEMERAL_START = 32768
_T = TypeVar("_T")


class PortTaken(RuntimeError):
    """A server could not listen on the port it was given: something took it between the choice and the bind."""


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range: every outgoing connection and bind(0) takes one from it."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LINUX_EPHEMERAL_START


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(first_ephemeral: int | None = None) -> int:
    """A free port between Ray's worker ports and the kernel's ephemeral range, for a server to be started on.

    A port from bind(0) is handed over after the probe socket closes: until the server binds it (seconds later for
    `ray start`), any outgoing connection on the machine may take it. Outside the ephemeral range only a program
    that chooses its port the same way can; spawning callers retry with a fresh port on PortTaken. On a machine
    whose ephemeral range leaves no room below it, bind(0) it is, and the retry covers the race."""
    top = first_ephemeral or ephemeral_start()
    for _ in range(100 if top > _FIRST_PORT else 0):
        port = random.randrange(_FIRST_PORT, top)
        if port_is_free(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def retry_port_taken(start: Callable[[bool], _T], attempts: int = 3) -> _T:
    """`start(fresh)`: fresh is False on the first try (the caller's ports) and True after a PortTaken, when it must
    choose new ones."""
    fresh = False
    for _ in range(attempts - 1):
        try:
            return start(fresh)
        except PortTaken:
            fresh = True
    return start(fresh)


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log_path: str | None = None,
              log_from: int = 0) -> None:
    """Polls `url` until it answers; fails early (with its log's tail from byte `log_from` on) if `proc` exits
    first: PortTaken when that log says its address was in use."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = _log_tail(log_path, log_from)
            raise (PortTaken if _PORT_TAKEN.search(tail) else RuntimeError)(
                f"{proc.args[0]} exited with code {proc.returncode} before {url} answered" + _ended_with(tail))
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s" + _ended_with(_log_tail(log_path, log_from)))


def _ended_with(tail: str) -> str:
    return f"; its output ended with:\n{tail}" if tail else ""


# how uvicorn, werkzeug and `ray start` (its dashboard, GCS or client server) say a port was taken
_PORT_TAKEN = re.compile(r"address already in use|failed to find a valid port|already occupied", re.IGNORECASE)


def _log_tail(log_path: str | None, start: int = 0, lines: int = 20) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path, errors="replace") as f:
        f.seek(start)
        return "".join(f.readlines()[-lines:])


def _log_size(log_path: str) -> int:
    """Where the output of a process about to append to `log_path` will begin."""
    return os.path.getsize(log_path) if os.path.exists(log_path) else 0


def spawn_serving(args: list[str], log_path: str, env: dict[str, str] | None, url: str, timeout: float,
                  grace: float = 15.0) -> subprocess.Popen:
    """Starts a helper server in its own process group (so stop_process ends all of it), output appended to a log;
    returns once `url` answers, or stops it and raises (PortTaken when its port was taken)."""
    log_from = _log_size(log_path)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(url, timeout, proc, log_path, log_from)
    except BaseException:
        stop_process(proc, grace)
        raise
    return proc


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL what is left of it after `grace` seconds: its members too,
    also when the leader is gone already (a `ray start` that failed leaves the GCS it started)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while _group_lives(proc) and time.monotonic() < deadline:
            time.sleep(0.1)
    proc.poll()


def _group_lives(leader: subprocess.Popen) -> bool:
    """A process of the group, zombies aside (an orphan's may wait for a reaper that never comes), still runs."""
    if leader.poll() is None:
        return True
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                state, _, group = f.read().rsplit(") ", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):  # not a process, or gone
            continue
        if int(group) == leader.pid and state != "Z":
            return True
    return False


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
    return spawn_serving(args + (["--data-dir", data_dir] if data_dir else []), log_path, env,
                         f"http://{host}:{port}/", 60)


@contextmanager
def local_s3_server(port: int | None = None, host: str = "127.0.0.1"):
    """An in-memory S3 server over HTTP on `host` (loopback unless told); yields its endpoint URL."""
    log_dir = tempfile.mkdtemp(prefix="moetune-s3-")

    def start(fresh: bool) -> tuple[subprocess.Popen, int]:
        chosen = port if port and not fresh else free_port()
        return spawn_s3_server(chosen, os.path.join(log_dir, "server.log"), host=host), chosen

    proc, port = retry_port_taken(start)
    try:
        yield f"http://{host}:{port}"
    finally:
        stop_process(proc)
        shutil.rmtree(log_dir, ignore_errors=True)


RAY_PORTS = ("gcs", "dashboard", "client")  # those `ray start` is handed
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
    those to listen on, free ones for the rest, and fresh ones for all when one was taken before Ray bound it.
    Ray's other ports are never handed over: its agents, raylet and workers bind port 0 themselves.
    """
    # Jobs run `python -m moetune.workers.entry.driver`: put this interpreter's bin first so they find our packages.
    path = f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"
    # Ray 2.60's `ray start` turns token auth on whenever ~/.ray/auth_token exists (any earlier local ray.init
    # leaves one), while its clients stay in the default mode, "disabled", and are refused: the mode is set here
    # unless the caller chose one, so a leftover file changes nothing.
    env = {**os.environ, "PATH": path, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), **_ONE_MACHINE,
           **(env or {})}

    def start(fresh: bool) -> tuple[subprocess.Popen, RayHead]:
        chosen = {name: (not fresh and (ports or {}).get(name)) or free_port() for name in RAY_PORTS}
        dashboard_url = f"http://127.0.0.1:{chosen['dashboard']}"
        proc = spawn_serving(_ray_start_args(num_cpus, temp_dir, chosen), os.path.join(temp_dir, "ray-start.log"),
                             env, f"{dashboard_url}/api/version", 90, grace=5)
        return proc, RayHead(gcs_address=f"127.0.0.1:{chosen['gcs']}", dashboard_url=dashboard_url, ports=chosen)

    return retry_port_taken(start)


def _ray_start_args(num_cpus: int, temp_dir: str, ports: dict[str, int]) -> list[str]:
    return [
        shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "start", "--head", "--block",
        f"--port={ports['gcs']}", f"--num-cpus={num_cpus}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ports['dashboard']}",
        # Fixed defaults (agent 52365, client 10001) would collide with any other Ray on this machine; a head
        # whose agent cannot bind still answers but accepts no job ("No available agent to submit job"), so the
        # agent binds a port of its own choosing (0) and reports it to the head: nothing to race for.
        "--dashboard-agent-listen-port=0", f"--ray-client-server-port={ports['client']}",
        # Ray's default worker ports, 10002-19999, are one pool for every head on the machine (the suite's, a
        # stack's, the user's): 0 has each worker bind a port of the kernel's choosing itself instead.
        "--min-worker-port=0", "--max-worker-port=0",
        f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]


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


def listening_socket(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket bound to `port` (0: any free one) and held: no other program can take the port between its
    choice and the server's start, and a port already taken fails here, in the caller, with the OS's error."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the port of a server just stopped
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@contextmanager
def control_plane_in_thread(app, listener: int | socket.socket, host: str = "127.0.0.1"):
    """Serves the FastAPI app with uvicorn from a background thread on `listener`: a socket from
    listening_socket, or a port bound here on `host` (loopback unless other machines' workers report to it);
    yields its base URL."""
    import threading

    import uvicorn

    sock = listener if isinstance(listener, socket.socket) else listening_socket(listener, host)
    bound_host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="moetune-control-plane",
                              daemon=True)
    thread.start()
    url = f"http://{bound_host}:{port}"
    try:
        wait_http(f"{url}/healthz", 30)
        yield url
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
