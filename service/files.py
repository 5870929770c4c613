"""Checks that a job's input objects exist before it is queued, and small reads of a job's outputs
(through api/storage: s3://, file://)."""

from __future__ import annotations

import json

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.models import ErrorInfo, JobCreate


def _filesystem(uri: str, s3_endpoint_url: str | None, quick: bool = False):
    # No listing cache: an object uploaded after a first failed check must be seen on the next one.
    return storage.filesystem(uri, s3_endpoint_url, quick=quick, listings_cache=False)


def _inputs(spec: JobCreate) -> list[tuple[str, str, str]]:
    """(param, uri to check, what it should be)."""
    inputs = [
        ("model", storage.join(spec.model, "config.json"), "a Hugging Face checkpoint folder with a config.json"),
        ("training_file", spec.training_file, "a JSONL file"),
    ]
    if spec.validation_file:
        inputs.append(("validation_file", spec.validation_file, "a JSONL file"))
    return inputs


def missing_input(spec: JobCreate, s3_endpoint_url: str | None) -> ErrorInfo | None:
    """The first input that does not exist or cannot be read, as the job's error; None when all are there.

    Other storage errors (endpoint down, timeouts) propagate: they are worth a retry, not a failed job.
    """
    for param, uri, expected in _inputs(spec):
        try:
            fs, path = _filesystem(uri, s3_endpoint_url)
            found = fs.exists(path)
        except PermissionError:
            return ErrorInfo(code=ErrorCode.file_not_accessible, param=param,
                             message=f"{param}: access to {uri} was denied")
        if not found:
            return ErrorInfo(code=ErrorCode.file_not_found, param=param,
                             message=f"{param}: {uri} does not exist (expected {expected})")
    return None


def read_json(uri: str, s3_endpoint_url: str | None) -> dict | None:
    """A small JSON object from storage, or None when it cannot be read now (missing, unreachable, not JSON)."""
    try:
        fs, path = _filesystem(uri, s3_endpoint_url, quick=True)
        with fs.open(path, "rb") as f:
            value = json.loads(f.read(1_000_000))
    except Exception:  # noqa: BLE001 - callers treat any storage trouble as "not there (yet)"
        return None
    return value if isinstance(value, dict) else None


def read_model_config(spec: JobCreate, s3_endpoint_url: str | None) -> dict | None:
    """The model's config.json, or None when it cannot be read now: then the file check before queueing and
    the driver's own check report it instead (it never fails the submission)."""
    return read_json(storage.join(spec.model, "config.json"), s3_endpoint_url)
