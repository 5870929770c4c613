"""Which base and adapter a caller's `model` means, asked of the control plane with the caller's own bearer
token (GET /v1/models/{model}), so tenants and tokens are the control plane's. Answers are kept briefly."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import httpx

from moetune.api.errors import ErrorCode
from moetune.api.serving import ModelObject


@dataclass(frozen=True)
class Refusal:
    """The control plane's own error answer (401, 404), passed on to the caller as it is."""

    status: int
    body: dict


class ModelResolver:
    def __init__(self, control_plane_url: str, ttl_s: float = 10.0):
        self.client = httpx.AsyncClient(base_url=control_plane_url.rstrip("/"), timeout=30)
        self.ttl_s = ttl_s
        self._cache: dict[tuple[str, str], tuple[float, ModelObject]] = {}

    async def resolve(self, authorization: str, model: str) -> ModelObject | Refusal:
        key = (hashlib.sha256(authorization.encode()).hexdigest(), model)
        hit = self._cache.get(key)
        if hit and time.monotonic() - hit[0] < self.ttl_s:
            return hit[1]
        answer = await self._get(f"/v1/models/{model}", authorization)
        if isinstance(answer, Refusal):
            return answer
        if answer.status_code != 200:  # refusals are not cached: a model appears as soon as its job succeeds
            return Refusal(answer.status_code, _error_body(answer))
        found = ModelObject.model_validate(answer.json())
        self._cache[key] = (time.monotonic(), found)
        return found

    async def list(self, authorization: str) -> tuple[int, dict]:
        answer = await self._get("/v1/models", authorization)
        if isinstance(answer, Refusal):
            return answer.status, answer.body
        return answer.status_code, _error_body(answer) if answer.status_code != 200 else answer.json()

    async def _get(self, path: str, authorization: str) -> httpx.Response | Refusal:
        try:
            return await self.client.get(path, headers={"Authorization": authorization})
        except httpx.HTTPError as e:  # the caller cannot be authenticated: a 503, not a stack trace
            return Refusal(503, {"error": {"code": ErrorCode.not_ready, "param": None,
                                           "message": f"The control plane did not answer: {e}"}})


def _error_body(answer: httpx.Response) -> dict:
    try:
        return answer.json()
    except ValueError:
        return {"error": {"code": "http_error", "message": answer.text[:500], "param": None}}
