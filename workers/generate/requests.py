"""What a caller hands the generation engine and what it gets back, and the errors it can meet."""

from __future__ import annotations

from dataclasses import dataclass

BASE = "__base__"  # the adapter name of rows that run the base model alone (PEFT's name for it)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0: greedy. Otherwise softmax(logits / temperature) cut to the top_p nucleus, drawn with the
    request's own generator (seeded by `seed`, else at random): same seed, same tokens, whatever else is batched.
    The tokenizer's eos always stops; `stop_token_ids` stop too. A stop token is not part of the answer."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}",
                                      "max_new_tokens")
        if self.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")


@dataclass(frozen=True)
class GenerationRequest:
    """`adapter`: None (or BASE) for the base model, else the URI (s3://..., file path) of a PEFT adapter of this
    base."""

    prompt_ids: list[int]
    adapter: str | None
    params: SamplingParams


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (finish_reason None), or the end of the answer (token_id None, finish_reason "stop":
    a stop token came, "length": max_new_tokens or the context were reached)."""

    token_id: int | None
    finish_reason: str | None


class InvalidRequestError(ValueError):
    """A request the engine cannot run as given (an HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus max_new_tokens beyond the model's context."""


class AdapterLoadError(Exception):
    """An adapter that cannot be loaded (missing, unreadable, not for this base); the cause in words. The engine
    keeps serving the base and the other adapters."""
