"""A real Prometheus server (Debian's `prometheus` package) run from the shipped deploy/prometheus config."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from moetune.service.embedded import free_port, stop_process, wait_http

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
SCRAPE_INTERVAL_S = 1


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found: install Debian's `prometheus` package (.ci/run does)")
    return path


class Prometheus:
    def __init__(self, url: str, targets_dir: Path):
        self.url, self.targets_dir = url, targets_dir

    def get(self, path: str, **params) -> dict:
        body = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()
        assert body["status"] == "success", body
        return body["data"]

    def query_range(self, expr: str, start: float, end: float) -> list[dict]:
        return self.get("query_range", query=expr, start=start, end=end, step=SCRAPE_INTERVAL_S)["result"]


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """The shipped prometheus.yml and alert rules with a 1 s scrape interval; workers announce themselves in
    `.targets_dir` (the config's file_sd directory)."""
    root = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"].update(scrape_interval=f"{SCRAPE_INTERVAL_S}s", evaluation_interval=f"{SCRAPE_INTERVAL_S}s")
    (workers,) = [job for job in config["scrape_configs"] if job["job_name"] == "moetune-workers"]
    workers["file_sd_configs"][0]["refresh_interval"] = f"{SCRAPE_INTERVAL_S}s"
    (root / "targets").mkdir()  # must exist before Prometheus starts, or it cannot watch it
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    for rules in config["rule_files"]:
        shutil.copy(PROMETHEUS_DIR / rules, root / rules)
    port = free_port()
    log_path = root / "prometheus.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary("prometheus"), f"--config.file={root / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={root / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/-/ready", timeout=60, proc=proc, log_path=str(log_path))
        yield Prometheus(url, root / "targets")
    finally:
        stop_process(proc)
