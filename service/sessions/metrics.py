"""Training sessions in /metrics: how many by status, read from the store at scrape time (as the jobs' counts)."""

from __future__ import annotations

import logging
from typing import get_args

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from moetune.api.models.training_sessions import SessionStatus
from moetune.service.sessions import records

log = logging.getLogger(__name__)


class SessionsCollector(Collector):
    def __init__(self, store):
        self.store = store

    def describe(self):
        return []

    def collect(self):
        try:
            counts = records.count_by_status(self.store)
        except Exception:
            log.exception("could not count training sessions for /metrics")
            return
        sessions = GaugeMetricFamily("moetune_training_sessions", "Training sessions by status.", labels=["status"])
        for status in get_args(SessionStatus):
            sessions.add_metric([status], counts.get(status, 0))
        yield sessions
