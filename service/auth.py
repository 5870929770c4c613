"""Who is calling: API bearer tokens map to tenants; each running job gets its own worker token."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

from moetune.api.errors import ErrorCode
from moetune.service.errors import APIException


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_job_token() -> str:
    return secrets.token_urlsafe(32)


def job_token_matches(token: str | None, stored_hash: str | None) -> bool:
    if not token or not stored_hash:
        return False
    return hmac.compare_digest(hash_token(token), stored_hash)


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def unauthorized(message: str, code: ErrorCode = ErrorCode.invalid_api_key) -> APIException:
    return APIException(401, code, message, headers={"WWW-Authenticate": "Bearer"})


class TenantResolver:
    """Looks tokens up by their hash, so the plaintext tokens are not kept around after startup."""

    def __init__(self, tenants_by_token: dict[str, str]):
        self._tenants = {hash_token(token): tenant for token, tenant in tenants_by_token.items()}

    def __call__(self, request: Request) -> str:
        """FastAPI dependency: the caller's tenant, or a 401."""
        token = bearer_token(request)
        if token is None:
            raise unauthorized("Missing bearer token: send 'Authorization: Bearer <token>'.")
        tenant = self.tenant_of(token)
        if tenant is None:
            raise unauthorized("Invalid API token.")
        return tenant

    def tenant_of(self, token: str) -> str | None:
        return self._tenants.get(hash_token(token))


async def current_tenant(request: Request) -> str:
    """FastAPI dependency for the public routes (async: it never blocks, so it skips the worker-thread hop)."""
    return request.app.state.tenant_resolver(request)
