"""The worker exporter's scrape waits, scraped over real HTTP (a GET is all a Prometheus scrape is)."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Gauge

from moetune.workers.reporting.exporter import Exporter


def _exporter(targets_dir=None) -> tuple[Exporter, Gauge, str]:
    registry = CollectorRegistry()
    step = Gauge("moetune_test_step", "step", registry=registry)
    exporter = Exporter(registry, local_rank=0, host="127.0.0.1", target_name="t", port_setting="0",
                        targets_dir=targets_dir)
    return exporter, step, f"http://{exporter.address}/metrics"


def test_unscraped_worker_never_waits():
    exporter, _, _ = _exporter()
    started = time.monotonic()
    assert exporter.await_scrape() is False
    exporter.close()
    assert time.monotonic() - started < 1


def test_close_waits_for_a_scrape_of_the_final_values():
    exporter, step, url = _exporter()
    for _ in range(2):  # a scraper 0.5 s apart: the wait is bounded by two such intervals
        httpx.get(url)
        time.sleep(0.5)
    step.set(8)
    closing = threading.Thread(target=exporter.close)
    closing.start()
    time.sleep(0.1)
    assert closing.is_alive(), "close() returned before the final values were scraped"
    final = httpx.get(url).text
    closing.join(timeout=5)
    assert not closing.is_alive() and "moetune_test_step 8.0" in final


def test_wait_gives_up_when_scraping_stops():
    exporter, _, url = _exporter()
    for _ in range(2):
        httpx.get(url)
        time.sleep(0.5)
    started = time.monotonic()
    assert exporter.await_scrape() is False
    assert 1.9 < time.monotonic() - started < 6  # two observed intervals + 1 s, not SCRAPE_WAIT_MAX_S
    exporter.close()


def test_a_worker_announced_for_discovery_waits_for_its_first_scrape(tmp_path):
    """file_sd: Prometheus finds the target only after its next refresh, so the first scrape is still on its way
    when training starts; the worker waits for it instead of starting unobserved."""
    exporter, _, url = _exporter(tmp_path)
    assert [f.name for f in tmp_path.iterdir()] == ["t.json"]
    threading.Timer(0.5, httpx.get, args=(url,)).start()
    started = time.monotonic()
    assert exporter.await_scrape() is True
    assert 0.4 < time.monotonic() - started < 5
    threading.Timer(0.2, httpx.get, args=(url,)).start()  # close() waits for one more scrape
    exporter.close()
    assert not list(tmp_path.iterdir())
