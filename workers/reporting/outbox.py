"""A bounded on-disk outbox of one process's reports to the control plane: appended as they are made, sent in order
and removed only once acknowledged, so reports made while the control plane is away are delivered when it is back.

Each outbox is a stream of its job's reports numbered 1, 2, ...: `<stream>:<seq>` is the report's Idempotency-Key,
which the control plane stores once (service/store/events.py, ReportStreamRow). The records are lines of one JSONL file;
only their offsets are kept in memory. Past `max_pending` unsent records, new events are dropped and counted, and a
warning event saying how many (and which steps' metrics) goes out in their place as soon as there is room again.
Checkpoint records and results are never dropped: they are few, and the job's history needs them. The outbox of a
process that died with reports unsent is sent by the job's next reporting process on the node (Outbox.orphans).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Record:
    seq: int
    report: dict  # a WorkerReport's `report`, as JSON


@dataclass
class _Dropped:
    """Events not kept while the outbox was full."""

    count: int = 0
    steps: list[int] = field(default_factory=list)  # the steps of the metrics among them

    def notice(self, bound: int) -> dict:
        steps = f", the metrics of steps {min(self.steps)}-{max(self.steps)} among them" if self.steps else ""
        return {"kind": "event", "level": "warn", "type": "message",
                "message": f"{self.count} events were dropped while the control plane could not be reached{steps}: "
                           f"the workers' outbox holds at most {bound} unsent reports",
                "data": {"dropped_events": self.count, "dropped_steps": sorted(self.steps)}}


class Outbox:
    def __init__(self, directory: str | os.PathLike, max_pending: int, stream: str | None = None):
        """A new stream in `directory` (one outbox per reporting process, a fresh stream each time); with `stream`,
        that stream's file as its process left it (see orphans)."""
        self.stream = stream or uuid.uuid4().hex[:16]
        self.max_pending = max_pending
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.path = Path(directory) / f"{self.stream}.jsonl"
        self._file = open(self.path, "a+b")
        try:  # held while this process lives: a file nobody holds is an orphan (its process died)
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise
        self._offsets: deque[tuple[int, int]] = deque()  # (seq, offset) of each unsent record, oldest first
        self._next_seq, self._acked = 1, 0
        self._dropped = _Dropped()
        self._lock = threading.Lock()
        if stream is not None:
            self._load()

    def _load(self) -> None:
        """The records its earlier process left; the ones sent but not yet truncated go again (the control plane
        acknowledges a redelivery without storing it twice)."""
        self._file.seek(0)
        offset = 0
        for line in self._file:
            if line.endswith(b"\n"):  # a line cut short by the process's death was never sent
                seq = json.loads(line)["seq"]
                self._offsets.append((seq, offset))
                self._next_seq = seq + 1
            offset += len(line)

    def append(self, report: dict) -> int | None:
        """Stores a report to send; its sequence number, or None when the outbox is full and it was dropped."""
        with self._lock:
            if len(self._offsets) >= self.max_pending and report["kind"] == "event":
                self._dropped.count += 1
                if report.get("type") == "metrics" and (report.get("data") or {}).get("step") is not None:
                    self._dropped.steps.append(report["data"]["step"])
                return None
            if self._dropped.count:  # the gap is said where it is, before the next report kept
                self._write(self._dropped.notice(self.max_pending))
                self._dropped = _Dropped()
            return self._write(report)

    def _write(self, report: dict) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        offset = self._file.seek(0, os.SEEK_END)
        self._file.write(json.dumps({"seq": seq, "report": report}).encode() + b"\n")
        self._file.flush()  # in the OS's hands: survives this process
        self._offsets.append((seq, offset))
        return seq

    def head(self) -> Record | None:
        """The oldest unsent record."""
        with self._lock:
            if not self._offsets:
                return None
            _, offset = self._offsets[0]
            self._file.seek(offset)
            line = json.loads(self._file.readline())
        return Record(line["seq"], line["report"])

    def acknowledge(self, seq: int) -> None:
        """The control plane has the head record (or refused it for good): it leaves the outbox."""
        with self._lock:
            if self._offsets and self._offsets[0][0] == seq:
                self._offsets.popleft()
                self._acked = seq
            if not self._offsets:  # all sent: the file starts over, so it never outgrows the unsent records
                self._file.truncate(0)

    @property
    def acked(self) -> int:
        """The newest acknowledged sequence number."""
        return self._acked

    @property
    def last_seq(self) -> int:
        return self._next_seq - 1

    def pending(self) -> int:
        return len(self._offsets)

    @classmethod
    def orphans(cls, directory: str | os.PathLike, max_pending: int) -> list[Outbox]:
        """The outboxes in `directory` whose processes died with reports unsent, taken over by this process."""
        taken = []
        for path in sorted(Path(directory).glob("*.jsonl"), key=lambda p: p.stat().st_mtime):
            if path.stat().st_size == 0:  # nothing to send (or just created: its process locks it before writing)
                continue
            try:
                taken.append(cls(directory, max_pending, stream=path.stem))
            except BlockingIOError:  # its process is alive
                continue
        return taken

    def close(self) -> None:
        """Closes the file; removes it when nothing is left unsent."""
        with self._lock:
            self._file.close()
            if not self._offsets:
                self.path.unlink(missing_ok=True)
