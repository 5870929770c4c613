"""Checks that a job's input objects exist before it is queued, and small reads of a job's outputs
(through api/storage: s3://, file://)."""

from __future__ import annotations

import json

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.models.base import SpecError
from moetune.api.models.run_config import RunConfig
from moetune.api.models.responses import ErrorInfo
from moetune.service.submission.storage_facts import StorageFacts


def _filesystem(uri: str, s3_endpoint_url: str | None, quick: bool = False):
    # No listing cache: an object uploaded after a first failed check must be seen on the next one.
    return storage.filesystem(uri, s3_endpoint_url, quick=quick, listings_cache=False)


def _inputs(job: RunConfig) -> list[tuple[str, str, str]]:
    """(param, uri to check, what it should be)."""
    inputs = [
        ("model", storage.join(job.model, "config.json"), "a Hugging Face checkpoint folder with a config.json"),
        ("training_file", job.training_file, "a JSONL file"),
    ]
    if job.validation_file:
        inputs.append(("validation_file", job.validation_file, "a JSONL file"))
    if job.evaluation is not None:
        inputs.append(("evaluation.file", job.evaluation.file, "a JSONL file of chat rows with references"))
    return inputs


def missing_input(job: RunConfig, s3_endpoint_url: str | None) -> ErrorInfo | None:
    """The first input that does not exist or cannot be read, as the job's error; None when all are there.

    Other storage errors (endpoint down, timeouts) propagate at once (no retries here): they are worth a retry
    with the scheduler's backoff, not a failed job.
    """
    for param, uri, expected in _inputs(job):
        try:
            fs, path = _filesystem(uri, s3_endpoint_url, quick=True)
            found = fs.exists(path)
        except PermissionError:
            return ErrorInfo(code=ErrorCode.file_not_accessible, param=param,
                             message=f"{param}: access to {uri} was denied")
        if not found:
            return ErrorInfo(code=ErrorCode.file_not_found, param=param,
                             message=f"{param}: {uri} does not exist (expected {expected})")
    return None


def read_json(uri: str, s3_endpoint_url: str | None, strict: bool = False) -> dict | None:
    """A small JSON object from storage, or None when it cannot be read now. Not there and not a JSON object are
    None too, unless `strict`: then FileNotFoundError and SpecError, for callers that must tell "not there" and
    "never readable" from "not now"."""
    try:
        return _read_object(uri, s3_endpoint_url, raise_missing=strict)
    except SpecError:
        if strict:
            raise
        return None


def _read_object(uri: str, s3_endpoint_url: str | None, raise_missing: bool = False) -> dict | None:
    """A small JSON object from storage; None when storage cannot give it now (FileNotFoundError when it says the
    object is not there, if asked); SpecError when it is not one."""
    raw = _read_raw(uri, s3_endpoint_url, raise_missing)
    return None if raw is None else _json_object(uri, raw)


def _read_raw(uri: str, s3_endpoint_url: str | None, raise_missing: bool = False) -> bytes | None:
    try:
        fs, path = _filesystem(uri, s3_endpoint_url, quick=True)
        return fs.cat_file(path)  # one GET (opening the object first would add a HEAD)
    except FileNotFoundError:
        if raise_missing:
            raise
        return None
    except Exception:  # noqa: BLE001 - callers treat any storage trouble as "not there (yet)"
        return None


def _json_object(uri: str, raw: bytes) -> dict:
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise SpecError("model", f"model: {uri} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise SpecError("model", f"model: {uri} is not a JSON object")
    return value


def read_model_config(model_uri: str, s3_endpoint_url: str | None, facts: StorageFacts | None = None) -> dict | None:
    """The config.json of the model folder at `model_uri`, or None when it cannot be read now: then the file check
    before queueing and the driver's own check report it instead. A config.json that is not a JSON object, a model
    folder that holds files but no config.json, or one that an existing S3 bucket does not hold, is a SpecError.
    `facts`: a config read within its TTL is not read again."""
    uri = storage.join(model_uri, "config.json")
    if facts is not None and (raw := facts.known(("config", s3_endpoint_url, uri))) is not None:
        return _json_object(uri, raw)  # parsed again: callers get a dict of their own
    try:
        raw = _read_raw(uri, s3_endpoint_url, raise_missing=True)
    except FileNotFoundError:  # storage answered: the folder is listed only then (an unreachable one costs no more)
        if (names := model_files(model_uri, s3_endpoint_url, facts)) and "config.json" not in names:
            raise SpecError("model", f"model: {model_uri.rstrip('/')} holds {len(names)} files but no config.json "
                                     "(expected a Hugging Face checkpoint folder)") from None
        if not names and _bucket_answers(model_uri, s3_endpoint_url):
            raise SpecError("model", f"model: {model_uri.rstrip('/')} does not exist (expected a Hugging Face "
                                     "checkpoint folder with a config.json)") from None
        return None
    if raw is None:
        return None
    config = _json_object(uri, raw)
    if facts is not None:
        facts.remember(("config", s3_endpoint_url, uri), raw)
    return config


def _bucket_answers(uri: str, s3_endpoint_url: str | None) -> bool:
    """Whether storage can vouch that nothing is at `uri`: an s3:// URI whose bucket exists. A file:// path is on
    the workers' file system, which the control plane may not see; a bucket that is missing or does not answer now
    is left, like those, to the file check before queueing (file_not_found before any worker starts)."""
    if not uri.startswith("s3://"):
        return False
    try:
        fs, path = _filesystem(uri, s3_endpoint_url, quick=True)
        return fs.exists(path.split("/", 1)[0])
    except Exception:  # noqa: BLE001 - no answer now: the check before queueing asks again
        return False


def model_files(model_uri: str, s3_endpoint_url: str | None, facts: StorageFacts | None = None) -> list[str] | None:
    """Names of the files directly in the model folder at `model_uri`; None when storage cannot list it now."""
    key = ("files", s3_endpoint_url, model_uri.rstrip("/"))
    if facts is not None and (names := facts.known(key)) is not None:
        return list(names)
    try:
        fs, path = _filesystem(model_uri, s3_endpoint_url, quick=True)
        names = [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except Exception:  # noqa: BLE001 - the driver lists it again
        return None
    if facts is not None and names:  # an empty listing may be a folder still being uploaded
        facts.remember(key, tuple(names))
    return names


def check_output_writable(location: str, job_id: str, s3_endpoint_url: str | None, default: bool = False,
                          facts: StorageFacts | None = None) -> None:
    """SpecError (param output_uri) when the output location's bucket does not exist or refuses writes (probed
    under the job's folder `location`/`job_id`); storage that does not answer now is left to the driver, which
    checks again before any worker starts. `default`: the job named no output_uri (the location is the server's
    MOETUNE_DEFAULT_OUTPUT_URI). `facts`: a location that took a probe within the TTL is not probed again."""
    key = ("writable", s3_endpoint_url, location)
    if facts is not None and facts.known(key):
        return
    output_uri = storage.join(location, job_id)
    where = f"{output_uri} (the server's default output location)" if default else output_uri
    try:
        storage.check_writable(output_uri, endpoint_url=s3_endpoint_url, quick=True)
    except FileNotFoundError:
        raise SpecError("output_uri", f"output_uri: {where}: its bucket does not exist") from None
    except PermissionError:
        raise SpecError("output_uri", f"output_uri: writing to {where} was denied") from None
    except Exception:  # noqa: BLE001 - unreachable now: the driver's check decides
        return
    if facts is not None:
        facts.remember(key, True)
