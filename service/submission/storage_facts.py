"""What job submission learns from storage about a URI (a model folder's config.json and file names, an output
location that takes writes), remembered for a few seconds so a run of creates naming the same model and output
location does not repeat the same round trips (they were most of a create's time).

Only what storage confirmed is remembered: a missing or unreadable object, or a refused write, is asked again on
the next request, so an upload after a failed check is seen at once. A change within the TTL to something that
was fine is caught by the driver, which checks every input and the output again before any worker starts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable

DEFAULT_TTL_S = 10.0


class StorageFacts:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: dict[Hashable, tuple[float, object]] = {}
        self._lock = threading.Lock()

    def known(self, key: Hashable):
        """The value remembered for `key`, or None when none is (or it is older than the TTL)."""
        with self._lock:
            entry = self._entries.get(key)
        return entry[1] if entry is not None and entry[0] > self._clock() else None

    def remember(self, key: Hashable, value: object) -> None:
        now = self._clock()
        with self._lock:
            if len(self._entries) >= self.max_entries:  # drop the expired; if none, start over
                self._entries = {k: e for k, e in self._entries.items() if e[0] > now}
                if len(self._entries) >= self.max_entries:
                    self._entries.clear()
            self._entries[key] = (now + self.ttl_s, value)
