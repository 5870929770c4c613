"""OpenAI's webhook endpoints API, per tenant: `POST /v1/webhook_endpoints` (the answer holds the signing secret,
once), list, retrieve, delete. Job events reach the endpoints through the outbox (service/webhooks/)."""

from __future__ import annotations

from fastapi import APIRouter

from moetune.api.errors import ErrorCode
from moetune.api.models.responses import ListPage
from moetune.api.models.webhooks import (
    WebhookEndpoint,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointWithSecret,
)
from moetune.service.errors import APIException, documented_errors
from moetune.service.routes.deps import StoreDep, Tenant
from moetune.service.store import Store
from moetune.service.store.webhooks import EndpointRow
from moetune.service.webhooks.endpoints import create_endpoint, delete_endpoint, get_endpoint, list_endpoints
from moetune.service.webhooks.signing import secret_hint

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"], responses=documented_errors(
        (400, "The request body could not be parsed"),
        (401, "Missing or invalid API token"),
        (404, "No such webhook endpoint for this tenant"),
        (422, "Invalid url or event_types; `error.param` names the field"),
    ))


def _fields(row: EndpointRow) -> dict:
    return {"id": row.id, "created_at": int(row.created_at), "name": row.name, "url": row.url,
            "event_types": row.event_types, "signing_secret_hint": secret_hint(row.secret)}


def _own(store: Store, tenant: str, endpoint_id: str, param: str | None = None) -> EndpointRow:
    row = get_endpoint(store, tenant, endpoint_id)
    if row is None:
        raise APIException(404, ErrorCode.not_found, f"No webhook endpoint with id {endpoint_id!r}.", param)
    return row


@router.post("", response_model=WebhookEndpointWithSecret)
def create(spec: WebhookEndpointCreate, tenant: Tenant, store: StoreDep) -> WebhookEndpointWithSecret:
    """The only answer with `signing_secret` (`whsec_<base64>`): verify deliveries with it, e.g. the `openai`
    SDK's `client.webhooks.unwrap(body, headers, secret=...)`."""
    row = create_endpoint(store, tenant, spec)
    return WebhookEndpointWithSecret(**_fields(row), signing_secret=row.secret)


@router.get("", response_model=ListPage[WebhookEndpoint])
def list_(tenant: Tenant, store: StoreDep, after: str | None = None, limit: int = 20) -> ListPage[WebhookEndpoint]:
    """Newest first; pass the page's `last_id` as `after` for the next page."""
    cursor = _own(store, tenant, after, "after") if after else None
    rows, has_more = list_endpoints(store, tenant, max(1, min(limit, 100)), cursor)
    data = [WebhookEndpoint(**_fields(r)) for r in rows]
    return ListPage(data=data, has_more=has_more, first_id=data[0].id if data else None,
                    last_id=data[-1].id if data else None)


@router.get("/{endpoint_id}", response_model=WebhookEndpoint)
def retrieve(endpoint_id: str, tenant: Tenant, store: StoreDep) -> WebhookEndpoint:
    return WebhookEndpoint(**_fields(_own(store, tenant, endpoint_id)))


@router.delete("/{endpoint_id}", response_model=WebhookEndpointDeleted)
def delete(endpoint_id: str, tenant: Tenant, store: StoreDep) -> WebhookEndpointDeleted:
    """Events not delivered yet are dropped with it."""
    delete_endpoint(store, _own(store, tenant, endpoint_id).id)
    return WebhookEndpointDeleted(id=endpoint_id, deleted=True)
