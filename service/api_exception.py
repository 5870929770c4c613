"""The exception a route (or a helper the CLI shares, such as serve_deploy) raises for a user-facing error; kept
free of FastAPI so client-side commands can raise and catch it without importing the server (errors.py renders it)."""

from __future__ import annotations

from moetune.api.errors import ErrorCode


class APIException(Exception):
    def __init__(self, status_code: int, code: ErrorCode, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code, self.code, self.message, self.param = status_code, code, message, param
        self.headers = headers
