"""Waiting, in a test or a benchmark, for something a real process does."""

from __future__ import annotations

import time


def wait_for(predicate, timeout: float, what: str, interval: float = 0.3):
    """`predicate()`'s first truthy value, polled every `interval` seconds; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
