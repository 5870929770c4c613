"""Which control-plane replica schedules: the holder of the `scheduler` lease in the shared database.

A thread of each replica takes or renews the lease every `scheduler_lease_renew_s`; a holder that stops renewing
(killed, paused, cut off from the database) loses it `scheduler_lease_s` later to the next replica that asks. The
lease's epoch, which grows with each new holder, is the fencing token: the scheduler's writes that lead to a Ray
submission are checked against it in their own transaction, so a paused old leader that wakes up changes nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid

from moetune.service.store import SCHEDULER_LEASE, Store

log = logging.getLogger(__name__)


class LeaderLease:
    def __init__(self, store: Store, duration_s: float, renew_s: float):
        self.store = store
        self.duration_s = duration_s
        self.renew_s = renew_s
        self.holder = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"  # unique per process, restarts included
        self._epoch: int | None = None
        self._valid_until = 0.0  # monotonic: when the lease ends at the latest, counted from before the renewal
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def epoch(self) -> int | None:
        """The epoch this replica holds the lease under now, or None (another replica schedules)."""
        return self._epoch if time.monotonic() < self._valid_until else None

    def still_held(self, epoch: int) -> bool:
        return self.epoch() == epoch

    def renew(self) -> None:
        asked_at = time.monotonic()
        try:
            epoch = self.store.acquire_lease(SCHEDULER_LEASE, self.holder, self.duration_s)
        except Exception:  # noqa: BLE001 - database down: the lease runs out locally when the database's does
            log.warning("could not renew the scheduler lease; retrying", exc_info=True)
            return
        if epoch is not None and epoch != self.epoch():
            log.info("replica %s took the scheduler lease (epoch %d)", self.holder, epoch)
        elif epoch is None and self.epoch() is not None:
            log.warning("replica %s lost the scheduler lease", self.holder)
        self._epoch = epoch
        self._valid_until = asked_at + self.duration_s if epoch is not None else 0.0

    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="moetune-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops renewing and hands the lease over at once (a clean shutdown: no takeover delay)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self.renew_s + 30)
            self._thread = None
        if self.epoch() is not None:
            self._epoch, self._valid_until = None, 0.0
            self.store.release_lease(SCHEDULER_LEASE, self.holder)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.renew()
            self._stopping.wait(self.renew_s)
