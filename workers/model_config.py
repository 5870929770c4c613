"""A checkpoint's config.json read from storage and checked before any worker is held: a model transformers can
build, and the request's LoRA and layout rules that need it (api.families.check_model_spec), as JobErrors naming
the field. A job's driver (workers.entry.checks) and a session's (workers.sessions.driver) run them."""

from __future__ import annotations

import json

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.families import check_model_spec, facts_of
from moetune.api.models.base import SpecError
from moetune.api.models.lora import LoraSpec
from moetune.api.models.parallelism import ParallelDims
from moetune.workers.errors import JobError
from moetune.workers.families import hf_config


def check_supported(config: dict, lora: LoraSpec, parallelism: ParallelDims) -> None:
    """The submission-time rules that need config.json, again here: the control plane skips them when it
    cannot read storage at submission."""
    try:
        check_model_spec(config, lora, parallelism)
    except SpecError as e:
        raise JobError(ErrorCode.invalid_request, e.message, e.param) from None


def read_remote_config(model_uri: str) -> dict:
    """config.json of the checkpoint at `model_uri`, checked to be a model transformers can build."""
    uri = storage.join(model_uri, "config.json")
    try:
        config = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        raise JobError(ErrorCode.model_not_found, f"model {model_uri}: no config.json there", "model") from None
    except (OSError, ValueError) as e:
        raise JobError(ErrorCode.invalid_model, f"model {model_uri}: config.json cannot be read ({e})",
                       "model") from None
    try:
        facts_of(config)  # a malformed field or an unsupported model_type in moetune's words, before transformers'
    except SpecError as e:
        raise JobError(ErrorCode.invalid_model, e.message, e.param) from None
    try:
        hf_config(config)
    except (KeyError, ValueError, TypeError) as e:
        raise JobError(ErrorCode.invalid_model, f"model {model_uri}: unsupported config.json ({e})", "model") from None
    return config
