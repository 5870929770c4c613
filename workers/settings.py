"""The workers' settings: every environment variable a driver or a worker reads (moetune.api.environment), parsed
in one place, once per process. Nothing else in moetune.workers reads the environment."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from moetune.api import environment as env
from moetune.api.images import ImageLimits
from moetune.api.uri_access import UriAccess

DEFAULT_MAX_WORKER_FAILURES = 3
DEFAULT_PLACEMENT_TIMEOUT_S = 600.0
DEFAULT_METRICS_PORT = 9470  # + local rank
_ANY_URI = '{"allow_file_uris": true}'  # a driver started without a control plane reads what its data names


def _cache_max_bytes(value: str) -> int | None:
    if not value.strip():
        return None
    try:
        gb = float(value)
    except ValueError:
        gb = -1.0
    if gb < 0:
        raise ValueError(f"{env.ENV_WEIGHTS_CACHE_MAX_GB}={value!r}: expected a size in GB (0 or more), e.g. 200")
    return int(gb * 1e9)


@dataclass(frozen=True)
class WorkerSettings:
    callback_url: str | None = None
    job_token: str | None = None
    s3_endpoint_url: str | None = None
    max_worker_failures: int = DEFAULT_MAX_WORKER_FAILURES
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    weights_cache_dir: str | None = None  # None: no cache
    weights_cache_max_bytes: int | None = None
    metrics_port: str = str(DEFAULT_METRICS_PORT)  # a port base, "0" (any free port) or "off"
    metrics_targets_dir: str | None = None
    inject_faults: str = ""  # tests only (workers.loop.faults)
    run_spec: str | None = None  # the driver's job (JobRunSpec as JSON)
    # The driver's: what the image URIs of the data files may reach (unset: anything), and the image limits.
    uri_access: UriAccess = field(default_factory=lambda: UriAccess.model_validate_json(_ANY_URI))
    image_limits: ImageLimits = field(default_factory=ImageLimits)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerSettings:
        cache_dir = environ.get(env.ENV_WEIGHTS_CACHE_DIR)
        if cache_dir is None:  # unset: a folder in the node's temp dir; empty: off
            cache_dir = os.path.join(tempfile.gettempdir(), "moetune", "weights-cache")
        return cls(
            callback_url=environ.get(env.ENV_CALLBACK_URL),
            job_token=environ.get(env.ENV_JOB_TOKEN),
            s3_endpoint_url=environ.get(env.ENV_S3_ENDPOINT_URL),
            max_worker_failures=int(environ.get(env.ENV_MAX_WORKER_FAILURES, DEFAULT_MAX_WORKER_FAILURES)),
            placement_timeout_s=float(environ.get(env.ENV_PLACEMENT_TIMEOUT_S, DEFAULT_PLACEMENT_TIMEOUT_S)),
            weights_cache_dir=cache_dir or None,
            weights_cache_max_bytes=_cache_max_bytes(environ.get(env.ENV_WEIGHTS_CACHE_MAX_GB, "")),
            metrics_port=environ.get(env.ENV_METRICS_PORT, str(DEFAULT_METRICS_PORT)).strip(),
            metrics_targets_dir=environ.get(env.ENV_METRICS_TARGETS_DIR) or None,
            inject_faults=environ.get(env.ENV_INJECT_FAULTS, ""),
            run_spec=environ.get(env.ENV_RUN_SPEC),
            uri_access=UriAccess.model_validate_json(environ.get(env.ENV_URI_ACCESS) or _ANY_URI),
            image_limits=ImageLimits.model_validate_json(environ.get(env.ENV_IMAGE_LIMITS) or "{}"),
        )


def worker_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a driver hands every worker of its group (moetune.api.environment.WORKER_ENV), from its environment."""
    return {name: environ[name] for name in env.WORKER_ENV if name in environ}


def enter_worker_env(forwarded: Mapping[str, str]) -> WorkerSettings:
    """In a worker process: take over the driver's variables, point DeepSpeed's compiled ops at this virtualenv's
    prebuilt ones (`make install` builds them there: a job never waits for a C++ build, and two virtualenvs never
    overwrite each other's), and read the settings."""
    os.environ.update(forwarded)
    use_prebuilt_ops()
    return WorkerSettings.from_env()


def torch_extensions_dir() -> str:
    return os.path.join(sys.prefix, "torch_extensions")


def use_prebuilt_ops() -> None:
    """This process finds DeepSpeed's compiled ops in this virtualenv (torch_extensions_dir) and checks them with
    this virtualenv's `ninja`: ninja 1.11 (Debian) and 1.13 (PyPI) hash build commands differently, so a process
    with the other one first on PATH rebuilt the op (~1-2 min on 2 cores) and the next process rebuilt it back."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != venv_bin:
        os.environ["PATH"] = os.pathsep.join([venv_bin, path]) if path else venv_bin
