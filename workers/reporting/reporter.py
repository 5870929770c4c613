"""Reports from the Ray job back to the control plane (events, metrics, checkpoints, the result).

Every report goes through an on-disk outbox (workers/reporting/outbox.py) and a sender thread posts them in order,
each under its Idempotency-Key, retrying with backoff until the control plane acknowledges it, however long it is
away: the control plane stores each once. Reporting never takes training down and, while the control plane is away,
never holds it up: a report waits for its acknowledgement only while the reports before it got theirs. The result,
a process's last word, waits (up to `flush_timeout_s`) until everything before it and itself are delivered.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
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
from moetune.workers.reporting.outbox import Outbox

log = logging.getLogger("moetune.reporter")
MAX_PENDING = 10_000  # unsent reports an outbox keeps: hours of steps' metrics
# A process exiting with reports unsent waits this long for them; what is left goes with the job's next reporting
# process on the node (a result itself waits flush_timeout_s).
EXIT_FLUSH_S = 60.0


def outbox_dir(job_id: str) -> str:
    """The job's outboxes on this node (not under the job's node directory: loading the model clears that)."""
    return os.path.join(tempfile.gettempdir(), "moetune-outbox", job_id)


class Reporter:
    def __init__(self, job_id: str, callback_url: str | None, token: str | None, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, ack_wait_s: float = 10.0, flush_timeout_s: float = 900.0,
                 max_pending: int = MAX_PENDING, directory: str | None = None):
        """`callback_url` None: no control plane to report to (reports are only logged). A report waits up to
        `ack_wait_s` for its acknowledgement while the control plane answers; the result up to `flush_timeout_s`
        for everything to be delivered."""
        # Ray pickles a reporter into other processes (the Train controller's callbacks): each gets its own outbox.
        self._arguments = ((job_id, callback_url, token), dict(
            backoff_s=backoff_s, max_backoff_s=max_backoff_s, ack_wait_s=ack_wait_s, flush_timeout_s=flush_timeout_s,
            max_pending=max_pending, directory=directory))
        self.url = callback_url.rstrip("/") + REPORT_PATH.format(job_id=job_id) if callback_url else None
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.ack_wait_s, self.flush_timeout_s = ack_wait_s, flush_timeout_s
        self.control: str | None = None  # the control plane's request in its last answer ("pause"), see ReportAck
        directory = directory or outbox_dir(job_id)
        self.outbox = Outbox(directory, max_pending) if self.url else None
        # what this job's reporting processes that died here left unsent goes first, in the order they wrote it
        self._orphans = Outbox.orphans(directory, max_pending) if self.url else []
        self._changed = threading.Condition()
        self._failing = False  # the last post failed: the sender is backing off
        self._closed = False
        self._refused: set[int] = set()  # reports the control plane refused for good
        if self.outbox is not None:
            threading.Thread(target=self._send_loop, name="moetune-reporter", daemon=True).start()
            atexit.register(self.close, EXIT_FLUSH_S)

    def __reduce__(self):
        args, kwargs = self._arguments
        return _unpickled, (args, kwargs)

    def send(self, report) -> bool:
        """Queues one report; True when the control plane has accepted it by the time this returns (its answer is
        kept in `control`)."""
        body = WorkerReport(report=report).model_dump(mode="json")["report"]
        if self.outbox is None or self._closed:
            log.info("report (no callback URL, or the reporter closed): %s", body)
            return False
        with self._changed:
            seq = self.outbox.append(body)
            self._changed.notify_all()
        if seq is None:
            log.warning("outbox full (%d unsent reports): dropped %s", self.outbox.pending(), body)
            return False
        wait = self.flush_timeout_s if isinstance(report, ResultReport) else self.ack_wait_s
        return self._wait_for(seq, wait, while_answering=not isinstance(report, ResultReport))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Waits until every queued report is delivered (or refused); False when some are still unsent."""
        if self.outbox is None:
            return True
        return self._wait_for(self.outbox.last_seq, self.flush_timeout_s if timeout_s is None else timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flushes, then stops the sender; what is still unsent stays in the outbox's file (and is logged), for the
        job's next reporting process on this node once this one has exited."""
        if self.outbox is None or self._closed:
            return True
        delivered = self.flush(timeout_s)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if delivered:
            self.outbox.close()  # the sender is idle: nothing left to send
        else:
            log.error("%d reports not delivered (kept in %s)", self.outbox.pending(), self.outbox.path)
        return delivered

    def _wait_for(self, seq: int, timeout_s: float, while_answering: bool = False) -> bool:
        """Whether report `seq` is acknowledged within `timeout_s`; `while_answering`: give up at once while the
        control plane does not answer (training goes on; the sender keeps trying)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.outbox.acked < seq and not (while_answering and self._failing):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    break
                self._changed.wait(left)
            return self.outbox.acked >= seq and seq not in self._refused

    # ------------------------------------------------------------ the sender thread

    def _send_loop(self) -> None:
        with httpx.Client(headers=self.headers, timeout=10) as http:  # one connection, kept between reports
            self._send_all(http)

    def _send_all(self, http: httpx.Client) -> None:
        backoff = self.backoff_s
        while True:
            with self._changed:
                while not self._closed and self._next_outbox() is None:
                    self._changed.wait()
                if self._closed:
                    return
                outbox = self._next_outbox()
            record = outbox.head()
            outcome = self._post(http, outbox.stream, record.seq, record.report)
            with self._changed:
                self._failing = outcome is None
                if outcome is not None:
                    outbox.acknowledge(record.seq)
                    if not outcome and outbox is self.outbox:
                        self._refused.add(record.seq)
                    if outbox is not self.outbox and not outbox.pending():
                        self._orphans.remove(outbox)
                        outbox.close()
                self._changed.notify_all()
            if outcome is None:  # the control plane is away: retried for as long as this process runs
                with self._changed:
                    self._changed.wait_for(lambda: self._closed, backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
            else:
                backoff = self.backoff_s

    def _next_outbox(self) -> Outbox | None:
        """The outbox to send from: the orphans' first, then this process's own."""
        return next((o for o in (*self._orphans, self.outbox) if o.pending()), None)

    def _post(self, http: httpx.Client, stream: str, seq: int, report: dict) -> bool | None:
        """True: accepted; False: refused for good (a 4xx will not get better by retrying: bad token, job gone);
        None: not answered, to be retried."""
        try:
            response = http.post(self.url, json={"report": report},
                                 headers={"Idempotency-Key": f"{stream}:{seq}"})
        except httpx.HTTPError as e:
            self._log_unreachable(f"{type(e).__name__}: {e}")
            return None
        if response.status_code >= 500:
            self._log_unreachable(f"HTTP {response.status_code}")
            return None
        if not response.is_success:
            log.warning("report rejected with HTTP %s: %s", response.status_code, response.text[:200])
            return False
        if self._failing:
            log.info("the control plane answers again; sending %d queued reports", self.outbox.pending())
        self.control = _ack(response).control
        return True

    def _log_unreachable(self, problem: str) -> None:
        if not self._failing:  # once per outage, not once per retry
            log.warning("the control plane does not take reports (%s); %d queued, retrying with backoff",
                        problem, self.outbox.pending())

    def event(self, message: str, level: EventLevel = EventLevel.info, type: str = "message",
              data: dict[str, Any] | None = None):
        return self.send(EventReport(message=message, level=level, type=type, data=data))

    def metrics(self, step: int, **values: Any):
        summary = ", ".join(f"{k}={_figure(v)}" for k, v in values.items())
        return self.event(f"Step {step}: {summary}", type="metrics", data={"step": step, **values})

    def checkpoint(self, step: int, uri: str, retired_steps: Iterable[int] = (), **metrics: Any):
        return self.send(CheckpointReport(step_number=step, uri=uri, metrics=CheckpointMetrics(step=step, **metrics),
                                          retired_steps=list(retired_steps)))

    def paused(self):
        return self.send(ResultReport(status="paused"))

    def failed(self, code: str, message: str, param: str | None = None):
        return self.send(ResultReport(status="failed", error=ErrorInfo(code=code, message=message, param=param)))


def _unpickled(args: tuple, kwargs: dict) -> Reporter:
    return Reporter(*args, **kwargs)


def _ack(response: httpx.Response) -> ReportAck:
    """The acknowledgement in an accepted report's answer; an empty or unreadable one asks for nothing."""
    try:
        return ReportAck.model_validate_json(response.content)
    except ValueError:
        return ReportAck()


def _figure(value) -> str:
    """A step figure as a person reads it in the event log: 4 significant digits; a per-layer figure (a dict) as
    `[layer: value, ...]` (its exact values are in the event's data)."""
    if isinstance(value, dict):
        return "[" + ", ".join(f"{k}: {_figure(v)}" for k, v in value.items()) + "]"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
