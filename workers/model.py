"""The base model: its config checked before any worker starts, then tokenizer + transformers model."""

from __future__ import annotations

import json

from moetune.api.families import check_model_spec
from moetune.api.models import JobCreate, SpecError
from moetune.api import storage
from moetune.workers.errors import JobError
from moetune.workers.weights.cache import ENV_CACHE_MAX_GB


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


def load_dtype(device):
    """bf16 on GPUs, fp32 on CPU (where bf16 matmuls are slow)."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def stream_base_model(model_uri: str, device, ep_rank: int = 0, ep_size: int = 1):
    """The transformers model with this rank's weights streamed from `model_uri` (see workers.weights):
    non-expert tensors in full, routed experts of its expert-parallel share only."""
    from moetune.workers.weights.loader import stream_model

    return stream_model(model_uri, device, load_dtype(device), ep_rank, ep_size)


def expert_parallel_rank(ep_size: int) -> int:
    """This rank's index in its expert-parallel group (creates DeepSpeed's groups; torch.distributed is up)."""
    if ep_size == 1:
        return 0
    from moetune.workers.parallel.experts import ep_group

    return ep_group(ep_size).rank


def load_summary(streamed, ep_size: int) -> tuple[str, dict]:
    """The job event of a streamed load: time, bytes and throughput, and whether the bytes were verified."""
    s = streamed.stats
    read = s.bytes_from_storage + s.bytes_from_cache
    data = {"load_seconds": round(streamed.seconds, 3), "bytes_needed": s.bytes_needed,
            "bytes_from_storage": s.bytes_from_storage, "bytes_from_cache": s.bytes_from_cache,
            "throughput_mib_s": round(read / 2**20 / max(streamed.seconds, 1e-9), 1), "requests": s.requests,
            "retries": s.retries, "bytes_not_cached": s.bytes_not_cached,
            "integrity": "verified" if streamed.verified else "unverified",
            "expert_parallel_size": ep_size}
    message = (f"Weights streamed: {read / 2**20:.1f} MiB in {streamed.seconds:.2f}s "
               f"({data['throughput_mib_s']} MiB/s; {s.bytes_from_cache / 2**20:.1f} MiB from the local cache)")
    if s.bytes_not_cached:
        message += (f"; {s.bytes_not_cached / 2**20:.1f} MiB not cached: the local weights cache is full "
                    f"({ENV_CACHE_MAX_GB} or its disk's free-space floor)")
    if not streamed.verified:
        message += "; integrity unverified: the checkpoint has no moetune-manifest.json (push it with `moetune models push`)"
    return message, data
