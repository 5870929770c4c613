"""The base model: its config checked before any worker starts, then tokenizer + transformers model."""

from __future__ import annotations

import json

from api.families import check_model_spec
from api.models import JobCreate, SpecError
from workers import storage
from workers.errors import JobError


def check_supported(spec: JobCreate, config: dict) -> None:
    """The submission-time rules that need config.json, again here: the control plane skips them when it
    cannot read storage at submission."""
    try:
        check_model_spec(config, spec)
    except SpecError as e:
        raise JobError("invalid_request", e.message, e.param) from None


def read_remote_config(model_uri: str) -> dict:
    """config.json of the checkpoint at `model_uri`, checked to be a model transformers can build."""
    from transformers import AutoConfig

    uri = storage.join(model_uri, "config.json")
    try:
        config = json.loads(storage.read_text(uri))
    except FileNotFoundError:
        raise JobError("model_not_found", f"model {model_uri}: no config.json there", "model") from None
    except (OSError, ValueError) as e:
        raise JobError("invalid_model", f"model {model_uri}: config.json cannot be read ({e})", "model") from None
    try:
        AutoConfig.for_model(**config)
    except (KeyError, ValueError, TypeError) as e:
        raise JobError("invalid_model", f"model {model_uri}: unsupported config.json ({e})", "model") from None
    return config


def load_tokenizer(local_dir: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_dir)
    if tokenizer.eos_token_id is None:
        raise JobError("invalid_model", "the model's tokenizer has no eos token", "model")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of loss and attention anyway
    return tokenizer


def load_model(local_dir: str, device):
    """The plain transformers model: bf16 on GPUs, fp32 on CPU (where bf16 matmuls are slow)."""
    import torch
    from transformers import AutoConfig

    from workers.families import auto_model_class

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = auto_model_class(AutoConfig.from_pretrained(local_dir)).from_pretrained(local_dir, dtype=dtype)
    return model.to(device)
