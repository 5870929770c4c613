"""Writing webhook events: in the transaction that changes the job, so an event is stored exactly when its change
is (a crash or restart before delivery leaves it in the outbox, the delivery loop sends it later). The app
subscribes enqueue_job_event to its store's job transitions (service/store/transitions.py)."""

from __future__ import annotations

import json
import secrets

from sqlalchemy import select
from sqlalchemy.orm import Session

from moetune.api.models.webhooks import WEBHOOK_EVENT_TYPES
from moetune.service.store import JobRow
from moetune.service.store.webhooks import PENDING, DeliveryRow, EndpointRow


def enqueue_job_event(s: Session, job_id: str, what: str, now: float, **data) -> None:
    """Queues `fine_tuning.job.<what>` for each endpoint of the job's tenant that subscribed to it; a `what` that
    is no event (a status such as running) queues nothing. `data` adds to the payload's `{"id": job_id}`."""
    event_type = f"fine_tuning.job.{what}"
    if event_type not in WEBHOOK_EVENT_TYPES:
        return
    tenant = select(JobRow.tenant).where(JobRow.id == job_id).scalar_subquery()
    endpoints = [e for e in s.scalars(select(EndpointRow).where(EndpointRow.tenant == tenant))
                 if event_type in e.event_types]
    if not endpoints:
        return
    event_id = f"evt_{secrets.token_hex(12)}"  # one id per event: each endpoint sees the same webhook-id
    body = json.dumps({"object": "event", "id": event_id, "type": event_type, "created_at": int(now),
                       "data": {"id": job_id, **data}}, separators=(",", ":"))
    s.add_all(DeliveryRow(event_id=event_id, endpoint_id=e.id, event_type=event_type, created_at=now, body=body,
                          status=PENDING, attempts=0, next_attempt_at=now) for e in endpoints)
