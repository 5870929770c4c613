"""The generation engine: the served base with its adapters, continuous batching of concurrent requests, and
`generate_batch` for evaluation on an already built model (workers.loop)."""

from moetune.workers.generate.decoding import generate_batch
from moetune.workers.generate.engine import Engine
from moetune.workers.generate.requests import (
    BASE,
    AdapterLoadError,
    ContextLengthError,
    GenerationRequest,
    InvalidRequestError,
    SamplingParams,
    TokenEvent,
)

__all__ = ["BASE", "AdapterLoadError", "ContextLengthError", "Engine", "GenerationRequest", "InvalidRequestError",
           "SamplingParams", "TokenEvent", "generate_batch"]
