"""Named leases between control-plane replicas (the scheduler's: service/cluster/leader.py), the fencing of writes
by the scheduler lease's epoch, and the slots lock that serializes giving out running slots."""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import BigInteger, Float, String, case, func, or_, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Mapped, Session, mapped_column
from sqlalchemy.sql.elements import ColumnElement

from moetune.service.store.base import Base, Database

SCHEDULER_LEASE = "scheduler"  # the leases row whose holder schedules (service/cluster/leader.py)
SLOTS_LOCK = "slots"  # the leases row locked while a slot is given (Leases.slots_locked; migration 0008)
_FENCED_IDLE_LIMIT_MS = 2000  # see Leases._fenced


class LeaseRow(Base):
    """A named lease held by one control-plane replica until `expires_at` (the database's clock); `epoch` grows by
    one whenever another holder takes it, so a write checked against it fences out every earlier holder."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(128))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[float] = mapped_column(Float)


def _database_now(dialect: str) -> ColumnElement:
    """The database's clock in epoch seconds: a lease's expiry never depends on two replicas' clocks agreeing."""
    if dialect == "sqlite":
        return (func.julianday("now") - 2440587.5) * 86400.0
    return func.extract("epoch", func.clock_timestamp())


class Leases(Database):
    def __init__(self, url: str):
        super().__init__(url)
        self._slots_lock = threading.Lock()
        # SQLite's slots lock between processes on one database file (see slots_locked); None in memory
        database = make_url(url).database if self.engine.dialect.name == "sqlite" else None
        self._slots_file = f"{database}.slots-lock" if database not in (None, "", ":memory:") else None

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
