"""`moetune up` / `moetune down`: the embedded stack (S3-compatible server, Ray head, control plane, SQLite) as
long-lived processes on loopback, their state in `.moetune/`.

`up` supervises: it checks each component (process alive, endpoint answering), adopts a healthy one, and restarts a
dead or hung one on the same ports and data, first stopping whatever is left of it (processes.py finds them by the
tag every component's environment carries), so no second copy ever runs beside an orphaned one. `down` stops every
process the stack started. The SQLite database lives in `.moetune/`, the objects too (the S3 server mirrors every
write into `.moetune/objects/` before answering it): jobs, uploaded files, models and outputs survive a crash of
any component as well as `down` / `up`. `stack.json` records ports, process ids, tokens and the last `up`'s
actions.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetune.api import storage
from moetune.service.local import processes
from moetune.service.local.embedded import (free_port, port_is_free, retry_port_taken, s3_env, spawn_ray_head,
                                            spawn_s3_server, spawn_serving, wait_http)

STATE_DIR = Path(".moetune")
TENANT = "local"
OUTPUT_BUCKET = "moetune"
DEFAULT_URL, DEFAULT_TOKEN = "http://127.0.0.1:8000", "dev-token"  # `moetune server`'s, without a stack
ROLES = ("s3", "ray", "server")  # start order (each needs the ones before it); stopped in reverse
_HEALTH_WAIT_S = 10.0  # how long a live component may take to answer before `up` counts it as hung


@dataclass
class Stack:
    url: str
    token: str
    s3_endpoint: str
    ray_address: str
    serve_url: str = ""  # where the Serve app's HTTP proxy listens once a model is deployed (`jobs deploy`, `chat`)
    pids: dict[str, int] = field(default_factory=dict)  # process-group leaders `up` started, by role
    ray_temp_dir: str | None = None  # a Ray head of its own (not one given with --ray-address)
    ray_ports: dict[str, int] = field(default_factory=dict)  # its ports, kept for a restart
    ray_num_cpus: int | None = None
    stack_id: str = field(default_factory=lambda: secrets.token_hex(6))  # the tag of its processes
    tenants: dict[str, str] = field(default_factory=dict)  # more tenants (`up --tenant`): name -> token
    server_config: dict = field(default_factory=dict)  # what the running control plane was started with
    last_up: dict[str, str] = field(default_factory=dict)  # role -> started, restarted or adopted

    def env(self) -> dict[str, str]:
        """What a shell needs to use the stack: the CLI's (deploy and serve talk to Ray, chat to the Serve app),
        the SDK's and boto3's variables."""
        return {"MOETUNE_URL": self.url, "MOETUNE_TOKEN": self.token, "MOETUNE_RAY_ADDRESS": self.ray_address,
                "MOETUNE_SERVE_URL": self.serve_url, **s3_env(self.s3_endpoint)}

    def health_url(self, role: str) -> str:
        return {"s3": f"{self.s3_endpoint}/", "ray": f"{self.ray_address}/api/version",
                "server": f"{self.url}/healthz"}[role]


def _state_file(state_dir: Path) -> Path:
    return state_dir / "stack.json"


def _saved(state_dir: Path) -> dict:
    path = _state_file(state_dir)
    return json.loads(path.read_text()) if path.exists() else {}


def _stack(saved: dict) -> Stack:
    known = Stack.__dataclass_fields__
    return Stack(**{k: v for k, v in saved.items() if k in known})


def _save(state_dir: Path, stack: Stack, base_models: dict[str, str]) -> None:
    path = _state_file(state_dir)
    path.with_suffix(".new").write_text(json.dumps({**asdict(stack), "base_models": base_models}, indent=2))
    path.with_suffix(".new").replace(path)


@contextmanager
def _locked(state_dir: Path):
    """One `up` or `down` at a time per state directory."""
    with open(state_dir / "stack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_stack(state_dir: Path = STATE_DIR) -> Stack | None:
    """The stack `up` started in `state_dir` while its control plane still runs; None otherwise."""
    saved = _saved(state_dir)
    stack = _stack(saved) if saved else None
    return stack if stack is not None and running(stack) else None


def running(stack: Stack) -> bool:
    return processes.alive(stack.pids.get("server"))


def connection(url: str | None, token: str | None, state_dir: Path = STATE_DIR) -> tuple[str, str, Stack | None]:
    """The control plane the CLI and the examples talk to, and the token: those given (a flag, MOETUNE_URL,
    MOETUNE_TOKEN), else those of the stack `up` started in `state_dir`, down or not (a call that finds it down
    says so: down_message), else `moetune server`'s defaults. The stack comes back when the URL is its."""
    saved = _saved(state_dir) if url is None or token is None else {}
    stack = _stack(saved) if saved else None
    return (url or (stack.url if stack else DEFAULT_URL), token or (stack.token if stack else DEFAULT_TOKEN),
            stack if url is None else None)


def down_message(state_dir: Path = STATE_DIR) -> str:
    where = state_dir if state_dir.is_absolute() else f"./{state_dir}"
    return f"the stack in {where} is down (its control plane does not answer): run `moetune up`"


def _port(url: str) -> int | None:
    return int(url.rsplit(":", 1)[1]) if url else None


def _port_like(port: int | None, fresh: bool = False) -> int:
    """The last run's port when it is free (the URL a user exported stays right), else (or when `fresh`: it was
    taken before the server bound it) a new one."""
    return port if port and not fresh and port_is_free(port) else free_port()


def _healthy(stack: Stack, role: str) -> bool:
    if not processes.alive(stack.pids.get(role)):
        return False
    try:
        wait_http(stack.health_url(role), _HEALTH_WAIT_S)
        return True
    except TimeoutError:
        return False


def _api_tokens(stack: Stack) -> str:
    """The stack's tenants, after those the user set in MOETUNE_API_TOKENS (kept, not overwritten)."""
    ours = [f"{stack.token}:{TENANT}", *(f"{token}:{name}" for name, token in stack.tenants.items())]
    return ",".join(filter(None, [os.environ.get("MOETUNE_API_TOKENS", "").strip(","), *ours]))


def _server_config(stack: Stack, base_models: dict[str, str]) -> dict:
    return {"api_tokens": _api_tokens(stack), "s3": stack.s3_endpoint, "ray": stack.ray_address,
            "serve": stack.serve_url, "base_models": base_models}


def up(state_dir: Path = STATE_DIR, ray_address: str | None = None, num_cpus: int | None = None,
       base_models: dict[str, str] | None = None, tenants: tuple[str, ...] = ()) -> Stack:
    """Brings every component up, adopting those that run and answer, restarting the others on their ports and
    data; `ray_address`: use that Ray cluster instead of a head of our own; `tenants`: more tenants, each with a
    token of its own (kept for later ups). `Stack.last_up` says what happened to each component."""
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "logs").mkdir(exist_ok=True)
    with _locked(state_dir):
        saved = _saved(state_dir)
        base_models = base_models or saved.get("base_models") or {}
        stack = _stack(saved) if saved else Stack(url=f"http://127.0.0.1:{free_port()}",
                                                  token=f"local-{secrets.token_hex(8)}", s3_endpoint="",
                                                  ray_address="")
        # a port of its own, not the Serve default 8001 another stack or program may hold
        stack.serve_url = stack.serve_url or f"http://127.0.0.1:{free_port()}"
        if ray_address is None and stack.pids and not stack.ray_ports:
            ray_address = stack.ray_address  # keep the cluster a running stack was given
        for name in tenants:
            stack.tenants.setdefault(name, f"{name}-{secrets.token_hex(8)}")
        stack.last_up = {}
        for role in ROLES:
            if role == "ray" and ray_address is not None:
                stack.ray_address, stack.ray_ports = ray_address, {}
                continue
            if role == "server" and stack.server_config != _server_config(stack, base_models):
                healthy = False  # tokens, endpoints or bases changed: it must start again to see them
            else:
                healthy = _healthy(stack, role)
            if healthy:
                stack.last_up[role] = "adopted"
                continue
            had = role in stack.pids
            processes.stop(stack.stack_id, role, stack.pids.pop(role, None))
            _start(role, stack, state_dir, base_models, num_cpus)
            stack.last_up[role] = "restarted" if had else "started"
            _save(state_dir, stack, base_models)
        _save(state_dir, stack, base_models)
    os.environ.update(s3_env(stack.s3_endpoint))  # this process's own S3 calls (the demo assets)
    return stack


def _start(role: str, stack: Stack, state_dir: Path, base_models: dict[str, str], num_cpus: int | None) -> None:
    """Starts the component on its last ports where they are free, on fresh ones where they were taken."""
    log_path = str(state_dir / "logs" / f"{role}.log")
    env = {**os.environ, **processes.tag(stack.stack_id, role)}
    if role == "s3":
        def start_s3(fresh: bool) -> None:
            port = _port_like(_port(stack.s3_endpoint), fresh)
            stack.pids["s3"] = spawn_s3_server(port, log_path, str(state_dir / "objects"), env).pid
            stack.s3_endpoint = f"http://127.0.0.1:{port}"

        retry_port_taken(start_s3)
        os.environ.update(s3_env(stack.s3_endpoint))  # this process's own S3 calls (buckets)
        _import_snapshot(stack.s3_endpoint, state_dir / "s3")
        storage.make_bucket(f"s3://{OUTPUT_BUCKET}", endpoint_url=stack.s3_endpoint)
    elif role == "ray":
        if not stack.ray_temp_dir or not os.path.isdir(stack.ray_temp_dir):
            stack.ray_temp_dir = tempfile.mkdtemp(prefix="moetune-ray-")  # short: Ray's socket paths are limited
        stack.ray_num_cpus = num_cpus or stack.ray_num_cpus or max(4, os.cpu_count() or 1)
        ports = {name: port for name, port in stack.ray_ports.items() if port_is_free(port)}
        proc, head = spawn_ray_head(stack.ray_num_cpus, {**s3_env(stack.s3_endpoint),
                                                         **processes.tag(stack.stack_id, role)},
                                    stack.ray_temp_dir, ports)
        stack.pids["ray"], stack.ray_address, stack.ray_ports = proc.pid, head.dashboard_url, head.ports
        # a new head runs no Serve proxy yet: keep the port unless something else took it (the server restarts then)
        stack.serve_url = f"http://127.0.0.1:{_port_like(_port(stack.serve_url))}"
    else:
        def start_server(fresh: bool) -> None:
            stack.url = f"http://127.0.0.1:{_port_like(_port(stack.url), fresh)}"
            stack.server_config = _server_config(stack, base_models)
            stack.pids["server"] = _spawn_server(stack, state_dir, base_models, env, log_path)

        retry_port_taken(start_server)


def _import_snapshot(s3_endpoint: str, snapshot_dir: Path) -> None:
    """A state directory from before durable storage kept `down`'s copy of every bucket in `s3/`: put it into the
    server once, then drop it (the server keeps the objects from then on)."""
    if not snapshot_dir.is_dir():
        return
    for bucket_dir in sorted(snapshot_dir.iterdir()):
        storage.make_bucket(f"s3://{bucket_dir.name}", endpoint_url=s3_endpoint)
        storage.upload_dir(str(bucket_dir), f"s3://{bucket_dir.name}", endpoint_url=s3_endpoint)
    shutil.rmtree(snapshot_dir)


def _server_env(stack: Stack, state_dir: Path, base_models: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    port = stack.url.rsplit(":", 1)[1]
    return {
        **env,
        **s3_env(stack.s3_endpoint),
        "MOETUNE_DATABASE_URL": f"sqlite:///{(state_dir / 'moetune.db').resolve()}",
        "MOETUNE_API_TOKENS": _api_tokens(stack),
        "MOETUNE_RAY_ADDRESS": stack.ray_address,
        "MOETUNE_CALLBACK_URL": f"http://127.0.0.1:{port}",
        "MOETUNE_DEFAULT_OUTPUT_URI": f"s3://{OUTPUT_BUCKET}/outputs",
        "MOETUNE_BASE_MODELS": json.dumps(base_models),
        "MOETUNE_SERVE_URL": stack.serve_url,
    }


def _spawn_server(stack: Stack, state_dir: Path, base_models: dict[str, str], env: dict[str, str],
                  log_path: str) -> int:
    args = [str(Path(sys.executable).with_name("moetune")), "server", "--port", stack.url.rsplit(":", 1)[1],
            "--log-level", "warning"]
    return spawn_serving(args, log_path, _server_env(stack, state_dir, base_models, env), f"{stack.url}/healthz",
                         60).pid


def down(state_dir: Path = STATE_DIR) -> bool:
    """Stops every process the stack started, the control plane first (nothing submits while Ray goes); its data
    stays for the next `up`. False when nothing was up."""
    if not (saved := _saved(state_dir)):
        return False
    with _locked(state_dir):
        stack = _stack(_saved(state_dir))
        if not any(processes.alive(pid) for pid in stack.pids.values()) and not processes.tagged(stack.stack_id):
            return False
        for role in reversed(ROLES):
            processes.stop(stack.stack_id, role, stack.pids.pop(role, None))
        processes.stop(stack.stack_id, None)  # anything else carrying the tag
        if stack.ray_temp_dir:
            shutil.rmtree(stack.ray_temp_dir, ignore_errors=True)
        stack.ray_temp_dir, stack.server_config = None, {}
        # the token, the ports and the bases stay for the next up
        _save(state_dir, stack, saved.get("base_models") or {})
    return True
