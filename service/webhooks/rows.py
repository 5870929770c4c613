"""The webhook tables (migration 0004). Their own declarative base: store.py imports the outbox, so this package
cannot import store.py's base at import time."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

PENDING, DELIVERED, GAVE_UP = "pending", "delivered", "gave_up"


class WebhookBase(DeclarativeBase):
    pass


class EndpointRow(WebhookBase):
    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    name: Mapped[str] = mapped_column(Text)
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(128))  # whsec_<base64>: the delivery loop signs with it
    event_types: Mapped[list] = mapped_column(JSON)


class DeliveryRow(WebhookBase):
    """One event for one endpoint; `next_attempt_at` is also the claim: a replica sending it pushes it past the
    request's timeout, so a crash mid-send makes it due again instead of losing it."""

    __tablename__ = "webhook_deliveries"

    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer(), "sqlite"), primary_key=True,
                                     autoincrement=True)
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
