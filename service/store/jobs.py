"""Jobs and their message events: creation, lookups, the queue's order, and status changes.

Status changes are conditional updates (`UPDATE ... WHERE status IN (...)`), so the HTTP routes, the worker reports
and the scheduler thread can race without one overwriting another's decision.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    bindparam,
    case,
    func,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from moetune.api.models.responses import JobStatus
from moetune.service.store.base import Base, SequenceKey
from moetune.service.store.leases import Leases

ACTIVE_STATUSES = tuple(s for s in JobStatus if not s.terminal)
# Jobs whose Ray submission holds one of the max_running_jobs slots (and its GPUs).
SLOT_STATUSES = (JobStatus.running, JobStatus.pausing)


class JobRow(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_status_priority_created", "status", "priority", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)  # epoch seconds, sub-second so age order is exact
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    spec: Mapped[dict] = mapped_column(JSON)  # the JobCreate request as posted (its inputs made URIs)
    # What the workers run (api.models.run_config.RunConfig), resolved once from the request at submission
    run_config: Mapped[dict | None] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    output_uri: Mapped[str] = mapped_column(Text)
    fine_tuned_model: Mapped[str | None] = mapped_column(Text)
    result_files: Mapped[list] = mapped_column(JSON, default=list)
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[dict | None] = mapped_column(JSON)
    progress: Mapped[dict] = mapped_column(JSON, default=dict)
    estimated_finish: Mapped[float | None] = mapped_column(Float)
    ray_submission_id: Mapped[str | None] = mapped_column(String(128))
    job_token_hash: Mapped[str | None] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # Set by a cancel (or a pause that raced a submission); cleared once the job's Ray submission was told to stop.
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Numbers the job's Ray submissions: a resume starts the next attempt under a new submission id.
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    # Why a queued job has not started yet (the cluster's free resources), shown on the job; None once it runs.
    queue_reason: Mapped[str | None] = mapped_column(Text)
    # The GPUs its workers take (num_workers x gpus_per_worker) and the GPU-seconds its ended runs used: the
    # tenant's GPU-hour budget (service/quotas.py). A run's time is added when it leaves a slot status.
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    gpu_seconds: Mapped[float] = mapped_column(Float, default=0.0)


class EventRow(Base):
    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(SequenceKey, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(16))
    type: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)


class IdempotencyKeyTaken(Exception):
    """Another request created a job with this tenant's idempotency key first."""


_JOB_FOR_TENANT = select(JobRow.__table__).where(JobRow.id == bindparam("id"), JobRow.tenant == bindparam("tenant"))


class Jobs(Leases):
    """The Store's job queries; a write given a `fence` (the scheduler lease's epoch) is checked against the lease."""

    def create_job(self, job: JobRow, first_events: Iterable[str | tuple[str, str]]) -> JobRow:
        """Insert a job with its first events (a message, or a message and its level); IdempotencyKeyTaken if the
        tenant's key is already used."""
        events = [(e, "info") if isinstance(e, str) else e for e in first_events]
        now = time.time()
        job.created_at = now
        try:
            with self._write() as s:
                s.add(job)
                s.flush()  # the job row must exist before its events (foreign key)
                s.add_all(EventRow(job_id=job.id, created_at=now, level=level, type="message", message=m)
                          for m, level in events)
        except IntegrityError as e:
            if job.idempotency_key is not None and self.find_by_idempotency_key(job.tenant, job.idempotency_key):
                raise IdempotencyKeyTaken() from e
            raise
        return job

    def find_by_idempotency_key(self, tenant: str, key: str) -> JobRow | None:
        with self._sessions() as s:
            return s.scalar(select(JobRow).where(JobRow.tenant == tenant, JobRow.idempotency_key == key))

    def get_job(self, job_id: str, tenant: str | None = None) -> JobRow | None:
        """The job, or None when unknown or (with `tenant`) owned by another tenant."""
        with self._sessions() as s:
            job = s.get(JobRow, job_id)
        return job if job is not None and (tenant is None or job.tenant == tenant) else None

    def read_job(self, job_id: str, tenant: str):
        """The tenant's job as a read-only row of its columns (read like a JobRow), or None. A plain select without
        an ORM session and identity map: a fraction of get_job's cost, for the most polled route."""
        with self.engine.connect() as conn:
            return conn.execute(_JOB_FOR_TENANT, {"id": job_id, "tenant": tenant}).first()

    def list_jobs(self, tenant: str, limit: int, after: JobRow | None = None) -> tuple[list[JobRow], bool]:
        """Newest first; `after` is the last job of the previous page."""
        query = select(JobRow).where(JobRow.tenant == tenant)
        if after is not None:
            query = query.where(or_(
                JobRow.created_at < after.created_at,
                (JobRow.created_at == after.created_at) & (JobRow.id < after.id),
            ))
        query = query.order_by(JobRow.created_at.desc(), JobRow.id.desc())
        return self._page(query, limit)

    def next_queued(self, limit: int) -> list[JobRow]:
        """Queued jobs in the order they should start: highest priority first; within a priority the tenants take
        turns (each tenant's oldest, then each one's second oldest, ...), so one tenant's many jobs do not starve
        another's few."""
        turn = func.row_number().over(partition_by=(JobRow.tenant, JobRow.priority),
                                      order_by=(JobRow.created_at, JobRow.id)).label("turn")
        turns = select(JobRow.id, turn).where(JobRow.status == JobStatus.queued).subquery()
        query = (select(JobRow).join(turns, turns.c.id == JobRow.id)
                 .order_by(JobRow.priority.desc(), turns.c.turn, JobRow.created_at, JobRow.id).limit(limit))
        with self._sessions() as s:
            return list(s.scalars(query))

    def jobs_with_status(self, *statuses: JobStatus) -> list[JobRow]:
        query = select(JobRow).where(JobRow.status.in_([str(s) for s in statuses])).order_by(JobRow.created_at)
        with self._sessions() as s:
            return list(s.scalars(query))

    def succeeded_jobs(self, tenant: str) -> list[JobRow]:
        """The tenant's jobs that produced a model, oldest first (GET /v1/models)."""
        query = select(JobRow).where(JobRow.tenant == tenant, JobRow.status == str(JobStatus.succeeded))
        with self._sessions() as s:
            return list(s.scalars(query.order_by(JobRow.created_at, JobRow.id)))

    def jobs_to_stop(self) -> list[JobRow]:
        """Cancelled (or paused) jobs whose Ray submission has not been confirmed stopped yet."""
        query = select(JobRow).where(JobRow.status.in_([JobStatus.cancelled, JobStatus.paused]),
                                     JobRow.cancel_requested.is_(True), JobRow.ray_submission_id.is_not(None))
        with self._sessions() as s:
            return list(s.scalars(query))

    def count_by_status(self) -> dict[str, int]:
        with self._sessions() as s:
            rows = s.execute(select(JobRow.status, func.count()).group_by(JobRow.status))
            return {status: count for status, count in rows}

    def transition(
        self,
        job_id: str,
        from_statuses: Iterable[JobStatus],
        to_status: JobStatus,
        message: str,
        level: str = "info",
        fence: int | None = None,
        **fields: Any,
    ) -> bool:
        """Move a job to `to_status` only if it is in one of `from_statuses`; records `message` as an event and
        tells the transition's listeners (transitions.py) in the same transaction.

        Returns False (and changes nothing) when another actor moved the job first, or when `fence` (a scheduler
        lease epoch) is no longer the lease's epoch: a deposed leader changes nothing.
        """
        now = time.time()
        if to_status.terminal:
            fields.setdefault("finished_at", now)
        if to_status == JobStatus.running:
            fields.setdefault("started_at", now)
        if to_status not in SLOT_STATUSES:  # a run ends: its GPU time counts against the tenant's budget
            fields.setdefault("gpu_seconds", case(
                (JobRow.status.in_([str(st) for st in SLOT_STATUSES]) & JobRow.started_at.is_not(None),
                 JobRow.gpu_seconds + (now - JobRow.started_at) * JobRow.gpus), else_=JobRow.gpu_seconds))
        with self._write() as s:
            if not self._fenced(s, fence):
                return False
            result = s.execute(
                update(JobRow)
                .where(JobRow.id == job_id, JobRow.status.in_([str(f) for f in from_statuses]))
                .values(status=to_status.value, **fields)
            )
            if result.rowcount != 1:
                return False
            s.add(EventRow(job_id=job_id, created_at=now, level=level, type="message", message=message))
            self.transitions.publish(s, job_id, to_status.value, now)
        return True

    def note_queue_reason(self, job_id: str, reason: str | None, only_if_status: Iterable[JobStatus],
                          level: str = "warn") -> bool:
        """Sets why a job waits (None: it no longer does); a new reason is also recorded as an event, once.
        False when nothing changed (same reason, or the job moved on)."""
        with self._write() as s:
            job = s.scalar(select(JobRow).where(JobRow.id == job_id).with_for_update())
            if job is None or job.status not in {str(st) for st in only_if_status} or job.queue_reason == reason:
                return False
            job.queue_reason = reason
            if reason is not None:
                s.add(EventRow(job_id=job_id, created_at=time.time(), level=level, type="message", message=reason))
        return True

    def update_job(self, job_id: str, only_if_status: Iterable[JobStatus] | None = None, fence: int | None = None,
                   **fields: Any) -> bool:
        """False when the job is gone, not in `only_if_status`, or `fence` is not the scheduler lease's epoch."""
        query = update(JobRow).where(JobRow.id == job_id)
        if only_if_status is not None:
            query = query.where(JobRow.status.in_([str(f) for f in only_if_status]))
        with self._write() as s:
            return self._fenced(s, fence) and s.execute(query.values(**fields)).rowcount == 1

    def ended_gpu_seconds(self) -> dict[str, float]:
        """Each tenant's GPU-seconds of ended runs (a running one's time so far is added by the quota check)."""
        query = select(JobRow.tenant, func.sum(JobRow.gpu_seconds)).where(JobRow.gpu_seconds > 0) \
            .group_by(JobRow.tenant)
        with self._sessions() as s:
            return {tenant: used for tenant, used in s.execute(query)}
