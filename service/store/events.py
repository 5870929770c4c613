"""What a job records while it runs: its events, its checkpoints, and which worker reports were taken, each once."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from moetune.api.models.responses import JobStatus
from moetune.service.store.base import Base, Database, SequenceKey
from moetune.service.store.jobs import EventRow, JobRow


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


class Events(Database):
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

    def add_checkpoint(self, job_id: str, step_number: int, uri: str, metrics: dict,
                       retired_steps: Iterable[int] = (), event: tuple[str, dict] | None = None,
                       report_key: ReportKey | None = None) -> None:
        """Lists a new checkpoint and, in the same transaction, stops listing the ones it retires, records `event`
        (message, data) and tells the transition listeners `checkpoint.created`; nothing when `report_key` was
        delivered before."""
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
            self.transitions.publish(s, job_id, "checkpoint.created", now, step_number=step_number)

    def list_checkpoints(self, job_id: str, limit: int,
                         after_seq: int | None = None) -> tuple[list[CheckpointRow], bool]:
        """Newest first, like OpenAI's checkpoint list."""
        query = select(CheckpointRow).where(CheckpointRow.job_id == job_id)
        if after_seq is not None:
            query = query.where(CheckpointRow.seq < after_seq)
        return self._page(query.order_by(CheckpointRow.seq.desc()), limit)

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
