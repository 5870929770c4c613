"""A job's events as a live Server-Sent-Events stream (polling the store, so any replica can serve it)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
from starlette.concurrency import run_in_threadpool

from moetune.api.models.responses import JobStatus
from moetune.service.store import Store
from moetune.service.views import event_id, event_view

POLL_INTERVAL_S = 0.25
KEEPALIVE_INTERVAL_S = 15.0
_BATCH = 100


async def job_event_stream(store: Store, job_id: str, after_seq: int | None) -> AsyncIterator[str]:
    """Yields `id:`/`data:` frames, keep-alive comments, and a final `event: done` once the job has ended."""
    last_write = time.monotonic()
    while True:
        # Read the status before the events: if the job was terminal then, its last event is already stored.
        job = await run_in_threadpool(store.get_job, job_id)
        terminal = job is None or JobStatus(job.status).terminal
        rows, has_more = await run_in_threadpool(store.list_events, job_id, _BATCH, after_seq)
        for row in rows:
            yield f"id: {event_id(row.seq)}\ndata: {event_view(row).model_dump_json()}\n\n"
            after_seq = row.seq
        if rows:
            last_write = time.monotonic()
        if has_more:
            continue
        if terminal:
            yield f"event: done\ndata: {json.dumps({'status': job.status if job else None})}\n\n"
            return
        if time.monotonic() - last_write >= KEEPALIVE_INTERVAL_S:
            yield ": keep-alive\n\n"
            last_write = time.monotonic()
        await anyio.sleep(POLL_INTERVAL_S)
