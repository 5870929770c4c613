"""The one declarative base every table's rows are declared on (the migrations' target: service/migrations/env.py),
and the database the store's parts share: its engine, sessions, write lock and migrations."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import BigInteger, Integer, create_engine, event, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import StaticPool

from moetune.service.store.transitions import JobTransitions

MIGRATIONS_DIR = Path(__file__).parent.parent / "migrations"
# Autoincrementing 64-bit keys; SQLite only autoincrements a column declared INTEGER.
SequenceKey = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


def make_engine(url: str) -> Engine:
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


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest revision (alembic `upgrade head`)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


class Database:
    """What every part of the Store (jobs.py, events.py, leases.py, files.py) works through."""

    def __init__(self, url: str):
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite takes one writer at a time and makes the others poll with growing sleeps (seconds of tail
        # latency under concurrent creates); queueing writers on a lock in-process avoids the polling.
        self._write_lock = threading.RLock() if self.engine.dialect.name == "sqlite" else nullcontext()
        self.reads_are_local = self.engine.dialect.name == "sqlite"  # a file on this machine, not a server
        # Told, inside the writing transaction, what happened to a job (the webhook outbox subscribes: app.py).
        self.transitions = JobTransitions()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._write_lock, self._sessions.begin() as s:
            yield s

    def _page(self, query, limit: int) -> tuple[list, bool]:
        with self._sessions() as s:
            rows = list(s.scalars(query.limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    def migrate(self) -> None:
        upgrade(self.engine)

    def ping(self) -> bool:
        try:
            with self.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def close(self) -> None:
        self.engine.dispose()
