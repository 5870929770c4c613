"""Who calls the Tinker router: the tenant whose moetune API token the `X-API-Key` carries in Tinker's form
(`tml-<token>`), from an SDK version this router was tested with."""

from __future__ import annotations

from fastapi import Request

from moetune.api.errors import ErrorCode
from moetune.service.errors import APIException, invalid_request

KEY_PREFIX = "tml-"
SDK_VERSIONS = ("0.38.0",)  # the `tinker` releases the suite runs (tests/tinker); others may speak otherwise
VERSION_HEADER = "X-Stainless-Package-Version"  # every request of the SDK carries its version


def check_sdk_version(version: str | None) -> None:
    if version not in SDK_VERSIONS:
        raise invalid_request(f"tinker SDK version {version!r} is not supported by this server (it speaks "
                              f"{', '.join(SDK_VERSIONS)}): install tinker=={SDK_VERSIONS[-1]}", VERSION_HEADER)


async def tinker_tenant(request: Request) -> str:
    """FastAPI dependency of every Tinker route: the caller's tenant, or a 401 (a 422 naming the version header for an SDK version it was not tested with)."""
    check_sdk_version(request.headers.get(VERSION_HEADER))
    key = request.headers.get("x-api-key", "")
    if not key.startswith(KEY_PREFIX):
        raise APIException(401, ErrorCode.invalid_api_key, f"Missing Tinker API key: send 'X-API-Key: "
                           f"{KEY_PREFIX}<your moetune API token>'.")
    tenant = request.app.state.tenant_resolver.tenant_of(key.removeprefix(KEY_PREFIX))
    if tenant is None:
        raise APIException(401, ErrorCode.invalid_api_key, "Invalid Tinker API key.")
    return tenant
