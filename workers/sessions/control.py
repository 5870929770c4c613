"""The chief's line to the control plane: readiness, the next call (long-polled), each call's outcome, the end."""

from __future__ import annotations

import time

import httpx

from moetune.api.models.responses import ErrorInfo
from moetune.api.models.training_sessions import (
    SESSION_INTERNAL,
    CallOutcome,
    GroupEnded,
    NextCall,
    SessionRunSpec,
)


class SessionLink:
    def __init__(self, callback_url: str, token: str, session: SessionRunSpec, attempts: int = 5):
        self.http = httpx.Client(base_url=callback_url.rstrip("/") + SESSION_INTERNAL.format(
            session_id=session.session_id), headers={"Authorization": f"Bearer {token}"}, timeout=30.0)
        self.params = {"attempt": session.attempt}
        self.attempts = attempts

    def _post(self, path: str, body: dict | None = None, timeout: float = 30.0) -> httpx.Response:
        """Retries what a restarting control plane answers (connection errors, 5xx); a 4xx is final."""
        for attempt in range(self.attempts):
            try:
                response = self.http.post(path, params=self.params, json=body, timeout=timeout)
                if response.status_code < 500:
                    response.raise_for_status()
                    return response
            except httpx.TransportError:
                if attempt + 1 == self.attempts:
                    raise
            time.sleep(0.5 * 2**attempt)
        response.raise_for_status()
        return response

    def ready(self) -> None:
        self._post("/ready")

    def next_call(self, wait_s: float) -> NextCall:
        """A 409 (this group was replaced, or the session ended) is an order to close."""
        try:
            response = self._post("/next_call", {"wait_s": wait_s}, timeout=wait_s + 30.0)
        except httpx.HTTPStatusError as e:
            if e.response.status_code == 409:
                return NextCall(close=True)
            raise
        return NextCall.model_validate(response.json())

    def outcome(self, call_id: str, result: dict | None, error: ErrorInfo | None) -> None:
        self._post(f"/calls/{call_id}", CallOutcome(result=result, error=error).model_dump(mode="json"))

    def ended(self, reason: str, error: ErrorInfo | None = None) -> None:
        try:
            self._post("/ended", GroupEnded(reason=reason, error=error).model_dump(mode="json"))
        except httpx.HTTPStatusError as e:
            if e.response.status_code != 409:  # a replaced group's end changes nothing
                raise
