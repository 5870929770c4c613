"""Loading failures a user can cause or fix: they name the shard and tensors involved."""

from __future__ import annotations

from moetune.api.errors import ErrorCode
from moetune.workers.errors import JobError


class WeightsError(JobError):
    def __init__(self, message: str):
        super().__init__(ErrorCode.invalid_model_weights, message, "model")
        self.args = (message,)


def tensor_list(names, limit: int = 8) -> str:
    names = sorted(names)
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
