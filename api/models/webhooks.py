"""Webhook endpoints and the events sent to them, shaped like OpenAI's (`/v1/webhook_endpoints`, and the
`{"object": "event", "id", "type", "created_at", "data": {"id": job_id}}` payload signed by Standard Webhooks)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

# OpenAI's three fine-tuning events, and moetune's pause and checkpoint.
WEBHOOK_EVENT_TYPES = tuple(f"fine_tuning.job.{what}" for what in (
    "succeeded", "failed", "cancelled", "paused", "checkpoint.created"))
WebhookEventType = Literal[WEBHOOK_EVENT_TYPES]


class WebhookEndpointCreate(BaseModel):
    """OpenAI's create parameters; `name` and `event_types` may be left out here (the URL's host, every event)."""

    model_config = {"extra": "forbid"}

    url: str = Field(max_length=2048)
    name: str | None = Field(default=None, max_length=256)
    event_types: list[WebhookEventType] = Field(default=list(WEBHOOK_EVENT_TYPES), min_length=1)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in ("http", "https") or not rest.split("/", 1)[0]:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value


class WebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    name: str
    url: str
    event_types: list[str]
    signing_secret_hint: str


class WebhookEndpointWithSecret(WebhookEndpoint):
    """The creation answer: the only one that holds the secret (Standard Webhooks' `whsec_<base64>`)."""

    signing_secret: str


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool
