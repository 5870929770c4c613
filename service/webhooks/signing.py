"""Standard Webhooks signatures, as OpenAI sends them: `webhook-signature: v1,<base64 HMAC-SHA256>` over
`<webhook-id>.<webhook-timestamp>.<body>`, keyed by the base64-decoded part of the endpoint's `whsec_` secret."""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "whsec_"


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def secret_hint(secret: str) -> str:
    """Enough to tell two secrets apart, never enough to sign."""
    return f"{secret[:len(PREFIX) + 3]}...{secret[-4:]}"


def signed_headers(secret: str, message_id: str, timestamp: int, body: str) -> dict[str, str]:
    key = base64.b64decode(secret.removeprefix(PREFIX))
    digest = hmac.new(key, f"{message_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": "v1," + base64.b64encode(digest).decode(), "content-type": "application/json"}
