"""The training-session tables (migrations 0006, 0007); their queries are service/sessions/records.py. Here, in
the core: the tenant quotas, which the scheduler reads, count open sessions too."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from moetune.service.store.base import Base, SequenceKey


class SessionRow(Base):
    __tablename__ = "training_sessions"
    __table_args__ = (Index("ix_training_sessions_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float] = mapped_column(Float)
    closed_at: Mapped[float | None] = mapped_column(Float)
    spec: Mapped[dict] = mapped_column(JSON)  # SessionCreate, model resolved to a URI
    seed: Mapped[int] = mapped_column(BigInteger)
    output_uri: Mapped[str] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, default=0)  # the worker group now serving (0 = the first)
    token_hash: Mapped[str | None] = mapped_column(String(64))  # the group's token (one per attempt)
    close_reason: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[dict | None] = mapped_column(JSON)
    # what the session holds against its tenant's quota while open, and the GPU-seconds it used once ended
    workers: Mapped[int] = mapped_column(Integer, default=0)
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    recoveries: Mapped[int] = mapped_column(Integer, default=0)  # failed groups replaced automatically


class CallRow(Base):
    """One call; `seq` orders a session's calls (the group takes them oldest first: one, or consecutive samples)."""

    __tablename__ = "training_session_calls"
    __table_args__ = (Index("ix_training_session_calls_session_status", "session_id", "status", "seq"),)

    seq: Mapped[int] = mapped_column(SequenceKey, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("training_sessions.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    args: Mapped[dict] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int | None] = mapped_column(Integer)  # the group that took it
    created_at: Mapped[float] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    result: Mapped[dict | None] = mapped_column(JSON)
    error: Mapped[dict | None] = mapped_column(JSON)
