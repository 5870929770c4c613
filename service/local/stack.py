"""`moetune up` / `moetune down`: the embedded stack (S3-compatible server, Ray head, control plane, SQLite) as
long-lived processes on loopback, their state in `.moetune/`.

The SQLite database lives there; the S3 server keeps objects in memory, so `down` copies every bucket into
`.moetune/s3/` before stopping it and `up` puts them back: jobs, uploaded files, models and outputs survive a
restart. `stack.json` records what `up` started (process groups, URLs, token); `down` stops only those.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetune.api import storage
from moetune.service.local.embedded import free_port, s3_env, spawn_ray_head, spawn_s3_server, wait_http

STATE_DIR = Path(".moetune")
TENANT = "local"
OUTPUT_BUCKET = "moetune"


@dataclass
class Stack:
    url: str
    token: str
    s3_endpoint: str
    ray_address: str
    pids: dict[str, int] = field(default_factory=dict)  # process-group leaders `up` started, by role
    ray_temp_dir: str | None = None  # a Ray head of its own (not one given with --ray-address)

    def env(self) -> dict[str, str]:
        """What a shell needs to use the stack: the CLI's (deploy and serve talk to Ray), the SDK's and boto3's
        variables."""
        return {"MOETUNE_URL": self.url, "MOETUNE_TOKEN": self.token, "MOETUNE_RAY_ADDRESS": self.ray_address,
                **s3_env(self.s3_endpoint)}


def _state_file(state_dir: Path) -> Path:
    return state_dir / "stack.json"


def _saved(state_dir: Path) -> dict:
    path = _state_file(state_dir)
    return json.loads(path.read_text()) if path.exists() else {}


def _stack(saved: dict) -> Stack:
    return Stack(**{k: v for k, v in saved.items() if k != "base_models"})


def read_stack(state_dir: Path = STATE_DIR) -> Stack | None:
    """The stack `up` started in `state_dir` while its control plane still runs; None otherwise."""
    saved = _saved(state_dir)
    stack = _stack(saved) if saved else None
    return stack if stack is not None and _alive(stack.pids.get("server")) else None


def _port_like(url: str | None) -> int:
    """The port of the last run's URL when it is free (the URL a user exported stays right), else a new one."""
    if url:
        port = int(url.rsplit(":", 1)[1])
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no obstacle
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                pass
    return free_port()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def _stop_group(pid: int, grace: float = 15.0) -> None:
    """SIGTERM the process group `up` started (its leader is `pid`), SIGKILL after `grace` seconds."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _save_buckets(s3_endpoint: str, snapshot_dir: Path) -> None:
    """Every bucket's objects into `snapshot_dir/<bucket>/` (replacing the previous snapshot)."""
    fs, _ = storage.filesystem("s3://", s3_endpoint, listings_cache=False)
    staging = snapshot_dir.with_name(snapshot_dir.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for bucket in fs.ls(""):
        bucket = bucket.rstrip("/")
        (staging / bucket).mkdir()
        keys = fs.find(bucket)
        # folder markers (an empty `a/` object, as Ray Train writes) are no files: their folders come with their files
        folders = {key[:i] for key in keys for i, char in enumerate(key) if char == "/"}
        for key in (k for k in keys if not k.endswith("/") and k not in folders):
            local = staging / key
            local.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(key, str(local))
    shutil.rmtree(snapshot_dir, ignore_errors=True)
    staging.rename(snapshot_dir)


def _restore_buckets(s3_endpoint: str, snapshot_dir: Path) -> None:
    for bucket_dir in sorted(snapshot_dir.iterdir()) if snapshot_dir.is_dir() else ():
        storage.make_bucket(f"s3://{bucket_dir.name}", endpoint_url=s3_endpoint)
        storage.upload_dir(str(bucket_dir), f"s3://{bucket_dir.name}", endpoint_url=s3_endpoint)


def _server_env(stack: Stack, state_dir: Path, base_models: dict[str, str]) -> dict[str, str]:
    port = stack.url.rsplit(":", 1)[1]
    return {
        **os.environ,
        **s3_env(stack.s3_endpoint),
        "MOETUNE_DATABASE_URL": f"sqlite:///{(state_dir / 'moetune.db').resolve()}",
        "MOETUNE_API_TOKENS": f"{stack.token}:{TENANT}",
        "MOETUNE_RAY_ADDRESS": stack.ray_address,
        "MOETUNE_CALLBACK_URL": f"http://127.0.0.1:{port}",
        "MOETUNE_DEFAULT_OUTPUT_URI": f"s3://{OUTPUT_BUCKET}/outputs",
        "MOETUNE_BASE_MODELS": json.dumps(base_models),
    }


def up(state_dir: Path = STATE_DIR, ray_address: str | None = None, num_cpus: int | None = None,
       base_models: dict[str, str] | None = None) -> Stack:
    """Starts the stack (or returns the one already up); `ray_address`: use that Ray cluster instead of starting
    a head. Data saved by the last `down` is put back before the control plane starts."""
    if (running := read_stack(state_dir)) is not None:
        return running
    state_dir.mkdir(parents=True, exist_ok=True)
    logs = state_dir / "logs"
    logs.mkdir(exist_ok=True)
    previous = _saved(state_dir)
    base_models = base_models or previous.get("base_models") or {}
    s3_port = _port_like(previous.get("s3_endpoint"))
    stack = Stack(url=f"http://127.0.0.1:{_port_like(previous.get('url'))}",
                  token=previous.get("token") or f"local-{secrets.token_hex(8)}",
                  s3_endpoint=f"http://127.0.0.1:{s3_port}", ray_address="")
    os.environ.update(s3_env(stack.s3_endpoint))  # this process's own S3 calls (restore, buckets, assets)
    try:
        stack.pids["s3"] = spawn_s3_server(s3_port, str(logs / "s3.log")).pid
        _restore_buckets(stack.s3_endpoint, state_dir / "s3")
        storage.make_bucket(f"s3://{OUTPUT_BUCKET}", endpoint_url=stack.s3_endpoint)
        if ray_address is None:
            stack.ray_temp_dir = tempfile.mkdtemp(prefix="moetune-ray-")  # short: Ray's socket paths are limited
            proc, head = spawn_ray_head(num_cpus or max(4, os.cpu_count() or 1), s3_env(stack.s3_endpoint),
                                        stack.ray_temp_dir)
            stack.pids["ray"], ray_address = proc.pid, head.dashboard_url
        stack.ray_address = ray_address
        stack.pids["server"] = _spawn_server(stack, state_dir, base_models)
    except BaseException:
        _stop(stack)
        raise
    _state_file(state_dir).write_text(json.dumps({**asdict(stack), "base_models": base_models}, indent=2))
    return stack


def _spawn_server(stack: Stack, state_dir: Path, base_models: dict[str, str]) -> int:
    log_path = state_dir / "logs" / "server.log"
    moetune = Path(sys.executable).with_name("moetune")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([str(moetune), "server", "--port", stack.url.rsplit(":", 1)[1],
                                 "--log-level", "warning"], env=_server_env(stack, state_dir, base_models),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"{stack.url}/healthz", 60, proc, str(log_path))
    return proc.pid


def _stop(stack: Stack) -> None:
    for role in ("server", "ray", "s3"):  # the control plane first: nothing submits while Ray goes
        if (pid := stack.pids.get(role)) is not None:
            _stop_group(pid)
    if stack.ray_temp_dir:
        shutil.rmtree(stack.ray_temp_dir, ignore_errors=True)


def down(state_dir: Path = STATE_DIR) -> bool:
    """Saves the buckets into `state_dir/s3/` and stops what `up` started; False when nothing was up."""
    if not (saved := _saved(state_dir)):
        return False
    stack = _stack(saved)
    if not any(_alive(pid) for pid in stack.pids.values()):
        return False
    if stack.pids.get("server") is not None:
        _stop_group(stack.pids.pop("server"))  # no job changes while the buckets are copied
    try:
        if _alive(stack.pids.get("s3")):
            os.environ.update(s3_env(stack.s3_endpoint))
            _save_buckets(stack.s3_endpoint, state_dir / "s3")
    finally:  # a failed copy must not leave the S3 server and the Ray head running
        _stop(stack)
    # the token, the URLs' ports and the bases stay for the next up
    _state_file(state_dir).write_text(json.dumps({**saved, "pids": {}, "ray_temp_dir": None}, indent=2))
    return True
