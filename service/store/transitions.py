"""What happened to a job, told to its listeners inside the transaction that records it: a status it entered
(`what` is the status: succeeded, cancelled, ...) or a checkpoint it saved (`checkpoint.created`). A listener
writes through the caller's session, so what it writes is committed exactly when the job's change is (the webhook
outbox, service/webhooks/outbox.py, subscribes where the app is wired: the store imports nothing above it)."""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy.orm import Session


class TransitionListener(Protocol):
    def __call__(self, s: Session, job_id: str, what: str, now: float, **data: Any) -> None: ...


class JobTransitions:
    def __init__(self):
        self._listeners: list[TransitionListener] = []

    def subscribe(self, listener: TransitionListener) -> None:
        self._listeners.append(listener)

    def publish(self, s: Session, job_id: str, what: str, now: float, **data: Any) -> None:
        """Runs every listener in `s`: one that raises rolls the job's change back with it."""
        for listener in self._listeners:
            listener(s, job_id, what, now, **data)
