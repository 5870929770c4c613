"""Debian's `prometheus` and `promtool` binaries, the shipped deploy/prometheus config, and a client of a running
Prometheus' HTTP API."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

from tests.support import REPO

PROMETHEUS_DIR = REPO / "deploy" / "prometheus"  # the shipped config and alert rules
SCRAPE_INTERVAL_S = 1


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found: install Debian's `prometheus` package (.ci/run does)")
    return path


class Prometheus:
    """A running Prometheus' HTTP API; workers announce their exporters as file_sd targets in `targets_dir`."""

    def __init__(self, url: str, targets_dir: Path):
        self.url, self.targets_dir = url, targets_dir

    def get(self, path: str, **params) -> dict:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.get("query_range", query=expr, start=start, end=end, step=SCRAPE_INTERVAL_S)["result"]
