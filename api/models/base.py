"""What every section of a job request shares: the strict base model, the URI and file-id forms, and SpecError
(a well-typed but inconsistent spec, naming the field)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

# memory:// is deliberately absent: it lives in one process and Ray workers are others.
URI_SCHEMES = ("s3://", "file://")


class StrictModel(BaseModel):
    # Unknown fields are a user error (a typo like `learning_rat` must not be silently ignored).
    model_config = ConfigDict(extra="forbid")


def check_uri(value: str | None) -> str | None:
    # The form only (and never the web): which storage schemes a tenant may use is the server's decision
    # (api.uri_access: file:// only where the operator enables it).
    if value is not None and ("://" not in value or value.startswith(("http://", "https://"))):
        raise ValueError("must be an object-storage URI such as s3://bucket/path")
    return value


FILE_ID_PREFIX = "file-"  # an uploaded file (POST /v1/files), usable wherever a job takes a data file's URI


def check_data_file(value: str | None) -> str | None:
    if value is not None and not value.startswith(FILE_ID_PREFIX):
        try:
            check_uri(value)
        except ValueError:
            raise ValueError(f"must be an uploaded file's id ({FILE_ID_PREFIX}...) or an object-storage URI such "
                             f"as s3://bucket/file.jsonl") from None
    return value


def check_model(value: str) -> str:
    if "://" in value:
        return check_uri(value)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
        raise ValueError("must be a registered base model's name (GET /v1/models) or a URI such as "
                         "s3://bucket/models/name")
    return value


class SpecError(ValueError):
    """A job spec that is well-typed but inconsistent; `param` is the offending field path."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
