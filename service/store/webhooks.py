"""The webhook tables (migration 0004); the endpoints' queries, the outbox and the delivery loop are
service/webhooks/."""

from __future__ import annotations

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from moetune.service.store.base import Base, SequenceKey

PENDING, DELIVERED, GAVE_UP = "pending", "delivered", "gave_up"


class EndpointRow(Base):
    __tablename__ = "webhook_endpoints"
    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    name: Mapped[str] = mapped_column(Text)
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(128))  # whsec_<base64>: the delivery loop signs with it
    event_types: Mapped[list] = mapped_column(JSON)


class DeliveryRow(Base):
    """One event for one endpoint; `next_attempt_at` is also the claim: a replica sending it pushes it past the
    request's timeout, so a crash mid-send makes it due again instead of losing it."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
    )

    seq: Mapped[int] = mapped_column(SequenceKey, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(40))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    event_type: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    body: Mapped[str] = mapped_column(Text)  # the exact JSON every attempt sends (and signs)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[float] = mapped_column(Float)
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[float | None] = mapped_column(Float)
