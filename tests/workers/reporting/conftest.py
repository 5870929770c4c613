"""A real Prometheus server (Debian's `prometheus` package) run from the shipped deploy/prometheus config, for the
real job whose exporters it scrapes."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from moetune.service.local.embedded import free_port, stop_process, wait_http
from tests.support.prometheus import PROMETHEUS_DIR, SCRAPE_INTERVAL_S, Prometheus, binary


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
