"""Long polls without hammering the database: a waiter wakes when this replica stores something it may want (a
call queued, a call finished), and every quarter second anyway for what another replica stored."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

T = TypeVar("T")
_RECHECK_S = 0.25


class Changes:
    def __init__(self):
        self._changed = threading.Condition()
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def notify(self) -> None:
        with self._changed:
            self._changed.notify_all()
            for loop, event in self._async_waiters:
                loop.call_soon_threadsafe(event.set)

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

    async def wait_for_async(self, check: Callable[[], T | None], wait_s: float) -> T | None:
        """wait_for without a thread held while waiting (`check` alone runs in the threadpool): for long polls that
        come by the hundred, the Tinker SDK's one per request; as many blocked threads would take the whole pool
        (40), and with it the calls that end their waits."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        deadline = time.monotonic() + wait_s
        with self._changed:
            self._async_waiters.add(waiter)
        try:
            while True:
                waiter[1].clear()  # before the check: a notify during it is not lost
                if (answer := await run_in_threadpool(check)) is not None:
                    return answer
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                with suppress(TimeoutError):
                    await asyncio.wait_for(waiter[1].wait(), min(left, _RECHECK_S))
        finally:
            with self._changed:
                self._async_waiters.discard(waiter)
