"""Every error leaves the service as `{"error": {"code", "message", "param"}}`, never with a stack trace."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ErrorInfo, ErrorResponse
from moetune.service.api_exception import APIException

# pydantic appends the union member it tried to a location, e.g. ("batch_size", "int") or
# ("target_modules", "literal['all-linear']"); such tags are not part of the field path.
_UNION_TAG = re.compile(r"^(int|float|str|bool|none|[a-z-]+\[.*\])$")
_LOCATION_ROOTS = ("body", "query", "path", "header", "cookie")


def job_not_found(job_id: str, param: str | None = None) -> APIException:
    return APIException(404, ErrorCode.job_not_found, f"No fine-tuning job with id {job_id!r}.", param)


def invalid_request(message: str, param: str | None = None) -> APIException:
    return APIException(422, ErrorCode.invalid_request, message, param)


def documented_errors(*errors: tuple[int, str]) -> dict[int, dict]:
    """A router's `responses`: each (status, description) answered with an ErrorResponse body."""
    return {code: {"model": ErrorResponse, "description": what} for code, what in errors}


def error_response(status_code: int, code: ErrorCode, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(code=code, message=message, param=param))
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


def field_path(loc: tuple) -> str | None:
    parts = list(loc[1:] if loc and loc[0] in _LOCATION_ROOTS else loc)
    return ".".join(str(p) for p in parts if not (isinstance(p, str) and _UNION_TAG.match(p))) or None


def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first["type"] == "json_invalid":
        return error_response(422, ErrorCode.invalid_request, "The request body is not valid JSON.")
    param = field_path(tuple(first["loc"]))
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return error_response(422, ErrorCode.invalid_request, message, param)


def _api_exception(_request: Request, exc: APIException) -> JSONResponse:
    return error_response(exc.status_code, exc.code, exc.message, exc.param, exc.headers)


def _http_exception(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: ErrorCode.not_found, 405: ErrorCode.method_not_allowed}
    return error_response(exc.status_code, codes.get(exc.status_code, ErrorCode.http_error), str(exc.detail),
                          headers=getattr(exc, "headers", None))


def _unhandled(_request: Request, _exc: Exception) -> JSONResponse:
    # Starlette re-raises after sending this response, so the server still logs the traceback.
    return error_response(500, ErrorCode.internal_error, "Internal server error; the incident was logged.")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIException, _api_exception)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(Exception, _unhandled)
