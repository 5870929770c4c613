"""Reports from the Ray job back to the control plane (events, metrics, checkpoints, the result).

Reporting must never take training down: failures are retried with backoff, then logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import httpx

from moetune.api.models.job_run import (
    REPORT_PATH,
    CheckpointReport,
    EventReport,
    ReportAck,
    ResultReport,
    WorkerReport,
)
from moetune.api.models.responses import CheckpointMetrics, ErrorInfo, EventLevel

log = logging.getLogger("moetune.reporter")


class Reporter:
    def __init__(self, job_id: str, callback_url: str | None, token: str | None, attempts: int = 5,
                 backoff_s: float = 0.5):
        """`callback_url` None: no control plane to report to (reports are only logged)."""
        self.url = callback_url.rstrip("/") + REPORT_PATH.format(job_id=job_id) if callback_url else None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.attempts, self.backoff_s = attempts, backoff_s
        self.control: str | None = None  # the control plane's request in its last answer ("pause"), see ReportAck

    def send(self, report) -> bool:
        """Posts one report; True when the control plane accepted it (its answer is kept in `control`)."""
        body = WorkerReport(report=report).model_dump(mode="json")
        if self.url is None:
            log.info("report (no callback URL): %s", body["report"])
            return False
        for attempt in range(self.attempts):
            try:
                response = httpx.post(self.url, json=body, headers=self.headers, timeout=10)
                if response.status_code < 500:
                    if response.is_success:
                        self.control = _ack(response).control
                        return True
                    # A 4xx will not get better by retrying (bad token, job gone).
                    log.warning("report rejected with HTTP %s: %s", response.status_code, response.text[:200])
                    return False
                problem = f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}"
            if attempt + 1 < self.attempts:
                time.sleep(self.backoff_s * 2**attempt)
        log.warning("report dropped after %d attempts (%s): %s", self.attempts, problem, body["report"])
        return False

    def event(self, message: str, level: EventLevel = EventLevel.info, type: str = "message",
              data: dict[str, Any] | None = None):
        return self.send(EventReport(message=message, level=level, type=type, data=data))

    def metrics(self, step: int, **values: Any):
        summary = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
        return self.event(f"Step {step}: {summary}", type="metrics", data={"step": step, **values})

    def checkpoint(self, step: int, uri: str, retired_steps: Iterable[int] = (), **metrics: Any):
        return self.send(CheckpointReport(step_number=step, uri=uri, metrics=CheckpointMetrics(step=step, **metrics),
                                          retired_steps=list(retired_steps)))

    def paused(self):
        return self.send(ResultReport(status="paused"))

    def failed(self, code: str, message: str, param: str | None = None):
        return self.send(ResultReport(status="failed", error=ErrorInfo(code=code, message=message, param=param)))


def _ack(response: httpx.Response) -> ReportAck:
    """The acknowledgement in an accepted report's answer; an empty or unreadable one asks for nothing."""
    try:
        return ReportAck.model_validate_json(response.content)
    except ValueError:
        return ReportAck()
