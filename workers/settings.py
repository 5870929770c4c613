"""The workers' settings: every environment variable a driver or a worker reads (moetune.api.environment), parsed
in one place, like the control plane's (service/settings.py), on pydantic-settings. Nothing else in moetune.workers
reads the environment (tests/workers/test_settings.py checks); writing it for Ray or for child processes is fine."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

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


def _node_weights_cache() -> str:
    return os.path.join(tempfile.gettempdir(), "moetune", "weights-cache")


class WorkerSettings(BaseSettings):
    """`WorkerSettings()` reads this process's environment: each field is the variable MOETUNE_<FIELD NAME> of
    moetune.api.environment, except the cache's size cap (set in GB)."""

    model_config = SettingsConfigDict(env_prefix="MOETUNE_", frozen=True)

    callback_url: str | None = None
    job_token: str | None = None
    s3_endpoint_url: str | None = None
    max_worker_failures: int = DEFAULT_MAX_WORKER_FAILURES
    placement_timeout_s: float = DEFAULT_PLACEMENT_TIMEOUT_S
    weights_cache_dir: str | None = Field(default_factory=_node_weights_cache)  # unset: the node's temp dir; "": off
    weights_cache_max_bytes: int | None = Field(None, validation_alias=env.ENV_WEIGHTS_CACHE_MAX_GB)
    metrics_port: str = str(DEFAULT_METRICS_PORT)  # a port base, "0" (any free port) or "off"
    metrics_targets_dir: str | None = None
    inject_faults: str = ""  # tests only (workers.loop.faults)
    test_perturb_op: str | None = None  # tests only: the operator the alignment check perturbs
    run_spec: str | None = None  # the driver's job (JobRunSpec as JSON)
    # The driver's: what the image URIs of the data files may reach (unset: anything), and the image limits.
    uri_access: Annotated[UriAccess, NoDecode] = Field(default_factory=lambda: UriAccess.model_validate_json(_ANY_URI))
    image_limits: Annotated[ImageLimits, NoDecode] = Field(default_factory=ImageLimits)
    git_commit: str | None = None  # set by an image build that knows its commit (the adaptation report's)

    @field_validator("weights_cache_dir", "metrics_targets_dir", "git_commit")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("weights_cache_max_bytes", mode="before")
    @classmethod
    def _gigabytes(cls, value):
        return _cache_max_bytes(value) if isinstance(value, str) else value

    @field_validator("metrics_port")
    @classmethod
    def _stripped(cls, value: str) -> str:
        return value.strip()

    @field_validator("uri_access", mode="before")
    @classmethod
    def _uri_access(cls, value):
        return UriAccess.model_validate_json(value or _ANY_URI) if isinstance(value, str) else value

    @field_validator("image_limits", mode="before")
    @classmethod
    def _image_limits(cls, value):
        return ImageLimits.model_validate_json(value or "{}") if isinstance(value, str) else value


def worker_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a driver hands every worker of its group (moetune.api.environment.WORKER_ENV), from its environment."""
    return {name: environ[name] for name in env.WORKER_ENV if name in environ}


def enter_worker_env(forwarded: Mapping[str, str]) -> WorkerSettings:
    """In a worker process: take over the driver's variables, point DeepSpeed's compiled ops at this virtualenv's
    prebuilt ones (`make install` builds them there: a job never waits for a C++ build, and two virtualenvs never
    overwrite each other's), and read the settings."""
    os.environ.update(forwarded)
    use_prebuilt_ops()
    return WorkerSettings()


def torch_extensions_dir() -> str:
    return os.path.join(sys.prefix, "torch_extensions")


def use_prebuilt_ops() -> str:
    """This process finds DeepSpeed's compiled ops in this virtualenv (torch_extensions_dir) and checks them with
    this virtualenv's `ninja`: ninja 1.11 (Debian) and 1.13 (PyPI) hash build commands differently, so a process
    with the other one first on PATH rebuilt the op (~1-2 min on 2 cores) and the next process rebuilt it back.
    Returns the extensions folder (TORCH_EXTENSIONS_DIR, when the environment names one)."""
    extensions = os.environ.setdefault("TORCH_EXTENSIONS_DIR", torch_extensions_dir())
    venv_bin = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != venv_bin:
        os.environ["PATH"] = os.pathsep.join([venv_bin, path]) if path else venv_bin
    return extensions
