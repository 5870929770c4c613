"""Persistence of jobs, their events and checkpoints (SQLAlchemy 2; SQLite by default, Postgres in production).

Status changes are conditional updates (`UPDATE ... WHERE status IN (...)`), so the HTTP routes, the
worker reports and the scheduler thread can race without one overwriting another's decision.
"""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
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
    create_engine,
    delete,
    event,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.pool import StaticPool

from moetune.api.models.responses import JobStatus
from moetune.service.webhooks.outbox import enqueue_job_event

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
ACTIVE_STATUSES = tuple(s for s in JobStatus if not s.terminal)
# Jobs whose Ray submission holds one of the max_running_jobs slots (and its GPUs).
SLOT_STATUSES = (JobStatus.running, JobStatus.pausing)
SCHEDULER_LEASE = "scheduler"  # the leases row whose holder schedules (service/cluster/leader.py)
_FENCED_IDLE_LIMIT_MS = 2000  # see Store._fenced
SLOTS_LOCK = "slots"  # the leases row locked while a slot is given (Store.slots_locked; migration 0008)
# Autoincrementing 64-bit keys; SQLite only autoincrements a column declared INTEGER.
SequenceKey = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


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
    spec: Mapped[dict] = mapped_column(JSON)  # JobCreate after resolve_spec
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


class LeaseRow(Base):
    """A named lease held by one control-plane replica until `expires_at` (the database's clock); `epoch` grows by
    one whenever another holder takes it, so a write checked against it fences out every earlier holder."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)


class EventRow(Base):
    __tablename__ = "events"

    seq: Mapped[int] = mapped_column(SequenceKey, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    level: Mapped[str] = mapped_column(String(16))
    type: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"

    seq: Mapped[int] = mapped_column(SequenceKey, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    step_number: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    metrics: Mapped[dict] = mapped_column(JSON)


class ReportStreamRow(Base):
    """The newest report accepted from one worker-side outbox of a job (workers/reporting/outbox.py: each numbers its
    reports 1, 2, ... and sends them in order until acknowledged): a report numbered at or below it is a redelivery
    whose acknowledgement was lost, acknowledged again but not stored twice."""

    __tablename__ = "report_streams"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    stream: Mapped[str] = mapped_column(String(64), primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)


ReportKey = tuple[str, int]  # a worker report's idempotency key within its job: (outbox stream, sequence number)


class FileRow(Base):
    """An uploaded data file (POST /v1/files); its bytes live at `uri` in the operator's bucket."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_created", "tenant", "created_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[float] = mapped_column(Float)
    filename: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    rows: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)


def _database_now(dialect: str) -> ColumnElement:
    """The database's clock in epoch seconds: a lease's expiry never depends on two replicas' clocks agreeing."""
    if dialect == "sqlite":
        return (func.julianday("now") - 2440587.5) * 86400.0
    return func.extract("epoch", func.clock_timestamp())


_JOB_FOR_TENANT = select(JobRow.__table__).where(JobRow.id == bindparam("id"), JobRow.tenant == bindparam("tenant"))


def _first_delivery(s: Session, job_id: str, key: ReportKey | None) -> bool:
    """Records report `key` as accepted in the caller's transaction; False when it was accepted before. The caller
    holds the job row's lock, so two deliveries of one key at once cannot both see it new."""
    if key is None:  # a report without a key (an older worker) is taken as it comes
        return True
    stream, seq = key
    row = s.get(ReportStreamRow, (job_id, stream))
    if row is None:
        s.add(ReportStreamRow(job_id=job_id, stream=stream, last_seq=seq))
        return True
    if seq <= row.last_seq:
        return False
    row.last_seq = seq
    return True


class IdempotencyKeyTaken(Exception):
    """Another request created a job with this tenant's idempotency key first."""


def _engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    in_memory = parsed.database in (None, "", ":memory:")
    if not in_memory:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        # Routes run in a thread pool and the scheduler in its own thread.
        connect_args={"check_same_thread": False, "timeout": 30},
        # An in-memory database exists once per connection: share a single one.
        poolclass=StaticPool if in_memory else None,
    )

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        cursor = dbapi_conn.cursor()
        if not in_memory:
            cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
            # WAL's recommended sync level: commits stay atomic and the file consistent; a power cut (not a
            # process crash) may drop the last commits. Production runs PostgreSQL.
            cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return engine


class Store:
    def __init__(self, url: str):
        self.engine = _engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite takes one writer at a time and makes the others poll with growing sleeps (seconds of tail
        # latency under concurrent creates); queueing writers on a lock in-process avoids the polling.
        self._write_lock = threading.RLock() if self.engine.dialect.name == "sqlite" else nullcontext()
        self.reads_are_local = self.engine.dialect.name == "sqlite"  # a file on this machine, not a server
        self._slots_lock = threading.Lock()
        # SQLite's slots lock between processes on one database file (see slots_locked); None in memory
        database = make_url(url).database if self.engine.dialect.name == "sqlite" else None
        self._slots_file = f"{database}.slots-lock" if database not in (None, "", ":memory:") else None

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions.begin() as s:
            yield s

    @contextmanager
    def slots_locked(self) -> Iterator[None]:
        """Serializes what gives out running slots and tenant quota (the scheduler starting jobs, a training session
        being created): each checks what is held and takes its share under it. PostgreSQL: every replica's, by a
        row lock held for the transaction; SQLite: every process's on the database file, by an exclusive lock on
        a file beside it (not BEGIN IMMEDIATE, nor the write lock: the holder writes through other connections,
        and the scheduler holds this lock across Ray submissions)."""
        with self._slots_lock:
            if self.engine.dialect.name == "sqlite":
                if self._slots_file is None:  # in memory: no other process sees this database
                    yield
                    return
                with open(self._slots_file, "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or its process dies
                    yield
                return
            with self._sessions.begin() as s:
                s.execute(select(LeaseRow.name).where(LeaseRow.name == SLOTS_LOCK).with_for_update())
                yield

    # ------------------------------------------------------------ lifecycle

    def migrate(self) -> None:
        """Bring the schema to the newest revision (alembic `upgrade head`)."""
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ jobs

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
        """Move a job to `to_status` only if it is in one of `from_statuses`; records `message` as an event.

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
            enqueue_job_event(s, job_id, to_status.value, now)  # succeeded, failed, cancelled, paused
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

    # ------------------------------------------------------------ leases

    def acquire_lease(self, name: str, holder: str, duration_s: float) -> int | None:
        """Takes lease `name` for `duration_s`, or renews it for its holder: the epoch it is now held under, or
        None while another holder's lease has not expired. A new holder gets the next epoch."""
        now = _database_now(self.engine.dialect.name)
        with self._write() as s:
            return s.scalar(
                update(LeaseRow)
                .where(LeaseRow.name == name, or_(LeaseRow.holder == holder, LeaseRow.expires_at < now))
                .values(epoch=case((LeaseRow.holder == holder, LeaseRow.epoch), else_=LeaseRow.epoch + 1),
                        holder=holder, expires_at=now + duration_s)
                .returning(LeaseRow.epoch))

    def release_lease(self, name: str, holder: str) -> None:
        """Lets the next replica take the lease at once instead of after its expiry."""
        with self._write() as s:
            s.execute(update(LeaseRow).where(LeaseRow.name == name, LeaseRow.holder == holder)
                      .values(expires_at=0.0))

    def _fenced(self, s: Session, fence: int | None) -> bool:
        """Whether `fence` is still the scheduler lease's epoch. The row is share-locked until the caller's
        transaction ends, so a takeover (which updates it) waits for the fenced write to commit or roll back.

        A leader paused inside that transaction (SIGSTOP, a frozen VM) would keep the lock, and the takeover
        waiting, until it resumes: PostgreSQL ends such a transaction once it idles _FENCED_IDLE_LIMIT_MS between
        statements (its statements go back to back otherwise), and the woken leader's write fails instead."""
        if fence is None:
            return True
        if self.engine.dialect.name == "postgresql":
            s.execute(text(f"SET LOCAL idle_in_transaction_session_timeout = {_FENCED_IDLE_LIMIT_MS}"))
        epoch = s.scalar(select(LeaseRow.epoch).where(LeaseRow.name == SCHEDULER_LEASE).with_for_update(read=True))
        return epoch == fence

    # ------------------------------------------------------------ events

    def add_event(
        self,
        job_id: str,
        message: str,
        level: str = "info",
        type: str = "message",
        data: dict | None = None,
        change_job: Callable[[JobRow], None] | None = None,
        unless_status: Iterable[JobStatus] = (),
        report_key: ReportKey | None = None,
    ) -> bool:
        """Append an event; `change_job` may modify the job row in the same transaction. False (nothing
        recorded) when the job's status is one of `unless_status`; True, nothing recorded, when `report_key` was
        delivered before.

        (`change_job` must assign JSON fields anew: in-place changes to a dict are not detected.)
        """
        with self._write() as s:
            # Locking the job row (a no-op on SQLite, which has one writer) makes a job's event
            # sequence numbers commit in order, so an `after` cursor never skips a late commit.
            job = s.scalar(select(JobRow).where(JobRow.id == job_id).with_for_update())
            if job.status in {str(status) for status in unless_status}:
                return False
            if not _first_delivery(s, job_id, report_key):
                return True
            if change_job is not None:
                change_job(job)
            s.add(EventRow(job_id=job_id, created_at=time.time(), level=level, type=type, message=message, data=data))
        return True

    def list_events(self, job_id: str, limit: int, after_seq: int | None = None,
                    newest_first: bool = False) -> tuple[list[EventRow], bool]:
        """Oldest first (the live stream), or newest first (the list, as OpenAI's); `after_seq` is the previous
        page's last event either way."""
        query = select(EventRow).where(EventRow.job_id == job_id)
        if newest_first:
            if after_seq is not None:
                query = query.where(EventRow.seq < after_seq)
            return self._page(query.order_by(EventRow.seq.desc()), limit)
        if after_seq is not None:
            query = query.where(EventRow.seq > after_seq)
        return self._page(query.order_by(EventRow.seq.asc()), limit)

    # ------------------------------------------------------------ checkpoints

    def add_checkpoint(self, job_id: str, step_number: int, uri: str, metrics: dict,
                       retired_steps: Iterable[int] = (), event: tuple[str, dict] | None = None,
                       report_key: ReportKey | None = None) -> None:
        """Lists a new checkpoint and, in the same transaction, stops listing the ones it retires and records
        `event` (message, data); nothing when `report_key` was delivered before."""
        with self._write() as s:
            s.execute(select(JobRow.id).where(JobRow.id == job_id).with_for_update())  # see add_event
            if not _first_delivery(s, job_id, report_key):
                return
            if retired_steps:
                s.execute(delete(CheckpointRow).where(CheckpointRow.job_id == job_id,
                                                      CheckpointRow.step_number.in_(list(retired_steps))))
            now = time.time()
            s.add(CheckpointRow(job_id=job_id, created_at=now, step_number=step_number, uri=uri, metrics=metrics))
            if event is not None:
                s.add(EventRow(job_id=job_id, created_at=now, level="info", type="message", message=event[0],
                               data=event[1]))
            enqueue_job_event(s, job_id, "checkpoint.created", now, step_number=step_number)

    def list_checkpoints(self, job_id: str, limit: int,
                         after_seq: int | None = None) -> tuple[list[CheckpointRow], bool]:
        """Newest first, like OpenAI's checkpoint list."""
        query = select(CheckpointRow).where(CheckpointRow.job_id == job_id)
        if after_seq is not None:
            query = query.where(CheckpointRow.seq < after_seq)
        return self._page(query.order_by(CheckpointRow.seq.desc()), limit)

    # ------------------------------------------------------------ report keys

    def delivered_before(self, job_id: str, key: ReportKey) -> bool:
        """Whether the job's report `key` (or a later one of its stream) was accepted before."""
        with self._sessions() as s:
            last = s.scalar(select(ReportStreamRow.last_seq).where(ReportStreamRow.job_id == job_id,
                                                                   ReportStreamRow.stream == key[0]))
        return last is not None and key[1] <= last

    def note_delivered(self, job_id: str, key: ReportKey) -> None:
        """Records report `key` as accepted, for a report whose effect is stored by other means (a result)."""
        with self._write() as s:
            s.execute(select(JobRow.id).where(JobRow.id == job_id).with_for_update())  # see add_event
            _first_delivery(s, job_id, key)

    # ------------------------------------------------------------ files

    def add_file(self, file: FileRow) -> FileRow:
        file.created_at = time.time()
        with self._write() as s:
            s.add(file)
        return file

    def get_file(self, file_id: str, tenant: str) -> FileRow | None:
        """The tenant's file; another tenant's is as unknown as a missing one."""
        with self._sessions() as s:
            file = s.get(FileRow, file_id)
        return file if file is not None and file.tenant == tenant else None

    def list_files(self, tenant: str, limit: int, after: FileRow | None = None,
                   purpose: str | None = None) -> tuple[list[FileRow], bool]:
        """Newest first; `after` is the last file of the previous page."""
        query = select(FileRow).where(FileRow.tenant == tenant)
        if purpose is not None:
            query = query.where(FileRow.purpose == purpose)
        if after is not None:
            query = query.where(or_(FileRow.created_at < after.created_at,
                                    (FileRow.created_at == after.created_at) & (FileRow.id < after.id)))
        return self._page(query.order_by(FileRow.created_at.desc(), FileRow.id.desc()), limit)

    def newest_files(self, limit: int) -> list[FileRow]:
        """Every tenant's, newest first (what /readyz checks storage still holds)."""
        with self._sessions() as s:
            return list(s.scalars(select(FileRow).order_by(FileRow.created_at.desc()).limit(limit)))

    def delete_file(self, file_id: str) -> None:
        with self._write() as s:
            s.execute(delete(FileRow).where(FileRow.id == file_id))

    # ------------------------------------------------------------ helpers

    def _page(self, query, limit: int) -> tuple[list, bool]:
        with self._sessions() as s:
            rows = list(s.scalars(query.limit(limit + 1)))
        return rows[:limit], len(rows) > limit
