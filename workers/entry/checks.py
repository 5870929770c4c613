"""What the driver checks before any worker starts: the rules of submission again (the control plane skips those
it cannot check when storage is unreachable), the model's config, the LoRA targets and every data row."""

from __future__ import annotations

import json

from moetune.api import storage
from moetune.api.errors import ErrorCode
from moetune.api.families import check_model_spec
from moetune.api.models import JobCreate, JobRunSpec, SpecError
from moetune.workers.data.rows import load_rows
from moetune.workers.errors import JobError
from moetune.workers.lora.peft_lora import check_targets_on_config


def validate(run: JobRunSpec) -> int:
    """Fails fast, before any worker starts: returns the number of training rows."""
    spec = run.spec
    config = read_remote_config(spec.model)
    check_supported(spec, config)
    check_targets_on_config(config, spec.lora)
    rows = len(load_rows(spec.training_file, "training_file"))
    if spec.validation_file:
        load_rows(spec.validation_file, "validation_file")
    return rows


def check_supported(spec: JobCreate, config: dict) -> None:
    """The submission-time rules that need config.json, again here: the control plane skips them when it
    cannot read storage at submission."""
    try:
        check_model_spec(config, spec)
    except SpecError as e:
        raise JobError(ErrorCode.invalid_request, e.message, e.param) from None


def read_remote_config(model_uri: str) -> dict:
    """config.json of the checkpoint at `model_uri`, checked to be a model transformers can build."""
    from transformers import AutoConfig

    uri = storage.join(model_uri, "config.json")
    try:
        config = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        raise JobError(ErrorCode.model_not_found, f"model {model_uri}: no config.json there", "model") from None
    except (OSError, ValueError) as e:
        raise JobError(ErrorCode.invalid_model, f"model {model_uri}: config.json cannot be read ({e})",
                       "model") from None
    try:
        AutoConfig.for_model(**config)
    except (KeyError, ValueError, TypeError) as e:
        raise JobError(ErrorCode.invalid_model, f"model {model_uri}: unsupported config.json ({e})", "model") from None
    return config
