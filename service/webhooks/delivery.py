"""The delivery loop, an asyncio task of the app: sends due outbox rows, signed at each attempt (the timestamp is
the attempt's, receivers refuse old ones), and retries a failure with capped, jittered exponential backoff until
Settings.webhook_retry_for_s after the event; then it gives up and says so in the job's events.

Every replica may run it: a row is claimed by a conditional update of its next_attempt_at, so two replicas never
send it at once, and a replica that dies mid-send leaves it due again once the claim lapses (at-least-once:
receivers drop repeats by webhook-id, as Standard Webhooks asks)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx
from sqlalchemy import select, update
from starlette.concurrency import run_in_threadpool

from moetune.service.store.webhooks import DELIVERED, GAVE_UP, PENDING, DeliveryRow, EndpointRow
from moetune.service.webhooks.signing import signed_headers

if TYPE_CHECKING:
    from moetune.service.settings import Settings
    from moetune.service.store import Store

log = logging.getLogger(__name__)
BATCH = 32


@dataclass(frozen=True)
class _Claimed:
    seq: int
    event_id: str
    body: str
    url: str
    secret: str
    attempts: int
    created_at: float


def retry_delay(attempts: int, settings: Settings) -> float:
    """Seconds before the next try after `attempts` failed ones: doubling from the base up to the cap, each drawn
    from its upper half so endpoints that failed together do not retry in step."""
    delay = min(settings.webhook_retry_max_s, settings.webhook_retry_base_s * 2 ** (attempts - 1))
    return random.uniform(delay / 2, delay)


class DeliveryLoop:
    def __init__(self, store: Store, settings: Settings):
        self.store, self.settings = store, settings
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Until stop(): a batch in flight is finished first, so a clean shutdown leaves no claim behind."""
        async with httpx.AsyncClient(timeout=self.settings.webhook_timeout_s,
                                     headers={"user-agent": "moetune-webhooks"}) as http:
            while not self._stop.is_set():
                try:
                    claimed = await run_in_threadpool(self._claim_due)
                    if claimed:
                        errors = await asyncio.gather(*(self._send(http, c) for c in claimed))
                        await run_in_threadpool(self._record, list(zip(claimed, errors)))
                        continue  # more may be due
                except Exception:  # the database away: the rows wait in the outbox
                    log.exception("webhook delivery pass failed")
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.settings.webhook_poll_interval_s)

    def _claim_due(self) -> list[_Claimed]:
        now = time.time()
        claim_until = now + 2 * self.settings.webhook_timeout_s
        due = (select(DeliveryRow, EndpointRow.url, EndpointRow.secret)
               .join(EndpointRow, EndpointRow.id == DeliveryRow.endpoint_id)
               .where(DeliveryRow.status == PENDING, DeliveryRow.next_attempt_at <= now)
               .order_by(DeliveryRow.next_attempt_at).limit(BATCH))
        with self.store._sessions() as s:
            rows = s.execute(due).all()
        if not rows:  # the usual pass: no write transaction
            return []
        claimed = []
        with self.store._write() as s:
            for row, url, secret in rows:
                taken = s.execute(update(DeliveryRow).where(
                    DeliveryRow.seq == row.seq, DeliveryRow.status == PENDING,
                    DeliveryRow.next_attempt_at == row.next_attempt_at).values(next_attempt_at=claim_until))
                if taken.rowcount == 1:
                    claimed.append(_Claimed(row.seq, row.event_id, row.body, url, secret, row.attempts,
                                            row.created_at))
        return claimed

    async def _send(self, http: httpx.AsyncClient, c: _Claimed) -> str | None:
        """None when the endpoint accepted the event (any 2xx), else what went wrong."""
        headers = signed_headers(c.secret, c.event_id, int(time.time()), c.body)
        try:
            response = await http.post(c.url, content=c.body.encode(), headers=headers)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"[:500]
        return None if response.is_success else f"HTTP {response.status_code}"

    def _record(self, outcomes: list[tuple[_Claimed, str | None]]) -> None:
        now = time.time()
        gave_up = []
        with self.store._write() as s:
            for c, error in outcomes:
                attempts = c.attempts + 1
                if error is None:
                    values = {"status": DELIVERED, "delivered_at": now, "last_error": None}
                elif now - c.created_at >= self.settings.webhook_retry_for_s:
                    values = {"status": GAVE_UP, "last_error": error}
                    gave_up.append((c, attempts, error))
                else:
                    values = {"next_attempt_at": now + retry_delay(attempts, self.settings), "last_error": error}
                s.execute(update(DeliveryRow).where(DeliveryRow.seq == c.seq, DeliveryRow.status == PENDING)
                          .values(attempts=attempts, **values))
        for c, attempts, error in gave_up:
            event = json.loads(c.body)
            self.store.add_event(event["data"]["id"], f"Webhook {event['type']} ({c.event_id}) to {c.url} given up "
                                 f"after {attempts} attempts over {(now - c.created_at) / 3600:.0f} h: {error}",
                                 level="warn")
