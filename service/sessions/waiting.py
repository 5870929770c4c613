"""Long polls without hammering the database: a waiter wakes when this replica stores something it may want (a
call queued, a call finished), and every quarter second anyway for what another replica stored."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_RECHECK_S = 0.25


class Changes:
    def __init__(self):
        self._changed = threading.Condition()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, check: Callable[[], T | None], wait_s: float) -> T | None:
        """`check()`'s first answer that is not None, or None once `wait_s` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._changed:  # checked under the lock: a notify between check and wait is not lost
                if (answer := check()) is not None:
                    return answer
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, _RECHECK_S))
