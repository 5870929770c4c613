"""A tenant's webhook endpoints in the database (the routes are service/routes/webhooks.py)."""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from sqlalchemy import delete, or_, select

from moetune.api.models.webhooks import WebhookEndpointCreate
from moetune.service.store.webhooks import EndpointRow
from moetune.service.webhooks.signing import new_secret

if TYPE_CHECKING:
    from moetune.service.store import Store


def create_endpoint(store: Store, tenant: str, spec: WebhookEndpointCreate) -> EndpointRow:
    row = EndpointRow(id=f"whep_{secrets.token_hex(12)}", tenant=tenant, created_at=time.time(),
                      name=spec.name or urlsplit(spec.url).hostname, url=spec.url, secret=new_secret(),
                      event_types=list(dict.fromkeys(spec.event_types)))
    with store._write() as s:
        s.add(row)
    return row


def get_endpoint(store: Store, tenant: str, endpoint_id: str) -> EndpointRow | None:
    """The tenant's endpoint; another tenant's is as unknown as a missing one."""
    with store._sessions() as s:
        row = s.get(EndpointRow, endpoint_id)
    return row if row is not None and row.tenant == tenant else None


def list_endpoints(store: Store, tenant: str, limit: int,
                   after: EndpointRow | None = None) -> tuple[list[EndpointRow], bool]:
    """Newest first; `after` is the last endpoint of the previous page."""
    query = select(EndpointRow).where(EndpointRow.tenant == tenant)
    if after is not None:
        query = query.where(or_(EndpointRow.created_at < after.created_at,
                                (EndpointRow.created_at == after.created_at) & (EndpointRow.id < after.id)))
    return store._page(query.order_by(EndpointRow.created_at.desc(), EndpointRow.id.desc()), limit)


def delete_endpoint(store: Store, endpoint_id: str) -> None:
    """Its undelivered events go with it (the foreign key cascades)."""
    with store._write() as s:
        s.execute(delete(EndpointRow).where(EndpointRow.id == endpoint_id))
