"""The HTTP endpoint Prometheus scrapes in each worker, and how Prometheus finds it.

Each worker serves on MOETUNE_METRICS_PORT + its local rank (one fixed port per local rank, so a Kubernetes
PodMonitor can name them). If that port is taken (two jobs' workers on one machine), the worker serves on a
free port instead and says so in a job event. With MOETUNE_METRICS_TARGETS_DIR set, each worker also writes
its address there as a Prometheus file_sd target file (removed when the worker ends), which is how a
Prometheus outside Kubernetes finds workers on any port.

A worker that is being scraped (or announced for file_sd, whose first scrape may still be on its way) waits for one
more scrape (at most two of the intervals it has seen + 1 s, never over SCRAPE_WAIT_MAX_S) twice: when training
starts, so that counters are seen at 0 before the first step (rate() and increase() cannot count what happened
before a series' first sample), and when it ends, so that the last steps' values, often the whole of a short job's
counters, reach Prometheus.
"""

from __future__ import annotations

import json
import os
import threading
import time

from prometheus_client import CollectorRegistry, start_http_server

from moetune.api.environment import ENV_METRICS_PORT

SCRAPE_WAIT_MAX_S = 60.0


class ScrapeWatch:
    """A collector that yields nothing: the registry calls collect() once per scrape, which is all it records."""

    def __init__(self):
        self.changed = threading.Condition()
        self.scrapes, self.last_at, self.interval = 0, None, None

    def describe(self) -> list:
        return []  # without this, registering would call collect() and count a scrape that never happened

    def collect(self) -> list:
        with self.changed:
            now = time.monotonic()
            if self.last_at is not None:
                self.interval = now - self.last_at
            self.scrapes, self.last_at = self.scrapes + 1, now
            self.changed.notify_all()
        return []

    def await_next(self, expected: bool) -> bool:
        """Waits for a scrape that starts from now on; False at once if nothing has ever scraped, unless a scrape
        is `expected` (the worker announced itself for discovery: the first one may still be on its way)."""
        with self.changed:
            if not self.scrapes and not expected:
                return False
            seen = self.scrapes
            # two intervals and a second of slack for a late scrape
            timeout = min(2 * self.interval + 1, SCRAPE_WAIT_MAX_S) if self.interval else SCRAPE_WAIT_MAX_S
            return self.changed.wait_for(lambda: self.scrapes > seen, timeout)


class Exporter:
    def __init__(self, registry: CollectorRegistry, local_rank: int, host: str, target_name: str,
                 port_setting: str, targets_dir: str | None):
        """`port_setting`: a port base (the worker serves on base + local rank), "0" (any free port) or "off";
        `targets_dir`: where to announce the address for Prometheus' file_sd (None: nowhere)."""
        self.server = self.target_file = None
        self.warnings: list[str] = []
        self.scrape_watch = ScrapeWatch()
        setting = port_setting
        if setting == "off":
            return
        try:
            base = int(setting)
        except ValueError:
            self.warnings.append(f"{ENV_METRICS_PORT}={setting!r} is not a port number or 'off': metrics not served")
            return
        wanted = base + local_rank if base else 0  # 0: any free port (tests, several jobs on one machine)
        registry.register(self.scrape_watch)
        try:
            self.server, _ = start_http_server(wanted, registry=registry)
        except OSError as e:
            self.server, _ = start_http_server(0, registry=registry)
            self.warnings.append(f"metrics port {wanted} unavailable ({e.strerror}); serving on "
                                 f"{self.server.server_port}, which only file_sd discovery finds")
        self.address = f"{host}:{self.server.server_port}"
        if targets_dir:
            os.makedirs(targets_dir, exist_ok=True)
            self.target_file = os.path.join(targets_dir, f"{target_name}.json")
            staging = self.target_file + ".tmp"  # Prometheus must never read a half-written file
            with open(staging, "w") as f:
                json.dump([{"targets": [self.address]}], f)
            os.replace(staging, self.target_file)

    def await_scrape(self) -> bool:
        """Returns after the next scrape (True), or at once if nothing scrapes this worker (False)."""
        return bool(self.server) and self.scrape_watch.await_next(expected=self.target_file is not None)

    def close(self) -> None:
        """After a final scrape, withdraws the target and stops serving. A response still being written
        finishes: only the listening socket closes."""
        self.await_scrape()
        if self.target_file:
            try:
                os.remove(self.target_file)
            except FileNotFoundError:
                pass
        if self.server:
            self.server.shutdown()
            self.server.server_close()
