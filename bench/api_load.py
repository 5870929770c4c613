"""Control-plane load: 64 concurrent clients against a real `moetune server` (uvicorn, SQLite).

Measures GET throughput on a job with all 64 clients polling (baseline: /healthz on the same server, i.e. the
HTTP stack's ceiling); the create rate that saturates the server (every client creating back to back) while the 64
clients poll at 1,000 GET/s in all (at most half the measured GET rate), then create latency (p50/p99) of jobs
submitted at half that rate amid the same polling (open loop, below saturation: latency measured at saturation only
measures the queue), plus, for reference, a burst where every client only creates (the single-writer ceiling, not in
the RESULT line); and 500 concurrent creates with Idempotency-Key (every key sent twice at once): no key may end up
with two jobs (duplicates) or none (lost).

    python bench/api_load.py [--clients 64] [--seconds 5]

The scheduler is off: this measures the API, not Ray. A moto S3 server holds the demo's tiny checkpoint, so every
create runs the submission checks it runs in production (config.json, tokenizer, output probe, data files; what
storage confirmed is remembered for seconds, as there) and `/readyz` finds its storage. Ends with
`RESULT get_per_s=<x> get_ratio=<GET job / GET /healthz> create_saturation_per_s=<s> create_rate_per_s=<s/2>
create_p99_ms=<y> duplicates=<n> lost=<m>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from moetune.service.local.demo import demo_job_spec, make_demo_assets
from moetune.service.local.embedded import free_port, s3_env, spawn_s3_server, stop_process

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support
from bench.support.server_process import start_server  # noqa: E402

JOBS = "/v1/fine_tuning/jobs"
SPEC = demo_job_spec().model_dump(mode="json", exclude_none=True)
TOKENS = {"load": "tok-load", "idem": "tok-idem"}
POLL_RATE = 1000.0  # GETs per second from all clients while creates are timed, at most half the measured GET rate


def start_storage(work: Path) -> tuple[subprocess.Popen, str]:
    """A moto S3 server holding the demo's checkpoint and data (what a create checks before accepting a job)."""
    port = free_port()
    proc = spawn_s3_server(port, str(work / "s3.log"))
    url = f"http://127.0.0.1:{port}"
    os.environ.update(s3_env(url))  # make_demo_assets writes through the same variables the server reads
    make_demo_assets(work, url, images=False)
    return proc, url


def client(url: str, tenant: str) -> aiohttp.ClientSession:
    # aiohttp rather than httpx: httpx's async pool saturated at ~300 req/s here, below the server.
    return aiohttp.ClientSession(base_url=url, headers={"Authorization": f"Bearer {TOKENS[tenant]}"},
                                 timeout=aiohttp.ClientTimeout(total=60), connector=aiohttp.TCPConnector(limit=0))


async def call(http: aiohttp.ClientSession, method: str, path: str, **kwargs) -> tuple[int, dict]:
    async with http.request(method, path, **kwargs) as response:
        return response.status, await response.json()


async def get_throughput(http: aiohttp.ClientSession, path: str, clients: int, seconds: float) -> float:
    """Requests per second that all `clients` loops complete for `seconds`; every answer must be a 200."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def loop():
        nonlocal done
        while time.perf_counter() < deadline:
            status, body = await call(http, "GET", path)
            assert status == 200, body
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return done / (time.perf_counter() - start)


async def amid_polling(http: aiohttp.ClientSession, job_path: str, clients: int, seconds: float, poll_rate: float,
                       creates) -> None:
    """Runs `creates(deadline)` while `clients` poll a job at `poll_rate` GETs per second in all."""
    start = time.perf_counter()
    deadline = start + seconds

    async def poll(first: float):
        at = first
        while at < deadline:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            status, body = await call(http, "GET", job_path)
            assert status == 200, body
            at += clients / poll_rate

    await asyncio.gather(*(poll(start + i / poll_rate) for i in range(clients)), creates(start, deadline))


async def create(http: aiohttp.ClientSession, latencies: list[float], since: float) -> None:
    status, body = await call(http, "POST", JOBS, json=SPEC)
    latencies.append(time.perf_counter() - since)
    assert status == 200, body


async def create_saturation(http: aiohttp.ClientSession, job_path: str, clients: int, seconds: float,
                            poll_rate: float) -> float:
    """Creates per second that `clients` closed loops complete amid the polling: the rate creates saturate at."""
    latencies: list[float] = []

    async def creates(start: float, deadline: float):
        async def loop():
            while time.perf_counter() < deadline:
                await create(http, latencies, time.perf_counter())
        await asyncio.gather(*(loop() for _ in range(clients)))

    started = time.perf_counter()
    await amid_polling(http, job_path, clients, seconds, poll_rate, creates)
    return len(latencies) / (time.perf_counter() - started)


async def creates_amid_polling(http: aiohttp.ClientSession, job_path: str, clients: int, seconds: float,
                               poll_rate: float, rate: float) -> list[float]:
    """Create latencies amid the polling with jobs submitted at `rate` per second.

    Open loop: each create starts on schedule whatever the others do, and its latency counts from that
    scheduled time, so a stalled server cannot hide its queue (no coordinated omission).
    """
    latencies: list[float] = []

    async def creates(start: float, deadline: float):
        async def at(when: float):
            await asyncio.sleep(max(0.0, when - time.perf_counter()))
            await create(http, latencies, when)
        await asyncio.gather(*(at(start + i / rate) for i in range(int(seconds * rate))))

    await amid_polling(http, job_path, clients, seconds, poll_rate, creates)
    return latencies


async def create_burst(http: aiohttp.ClientSession, clients: int, per_client: int) -> tuple[float, list[float]]:
    """(creates/s, latencies) when every client only creates: the write path's ceiling."""
    latencies: list[float] = []

    async def loop():
        for _ in range(per_client):
            start = time.perf_counter()
            status, body = await call(http, "POST", JOBS, json=SPEC)
            latencies.append(time.perf_counter() - start)
            assert status == 200, body

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return len(latencies) / (time.perf_counter() - start), latencies


async def idempotent_creates(http: aiohttp.ClientSession, requests: int) -> tuple[int, int]:
    """(duplicates, lost) after `requests` concurrent creates, each Idempotency-Key sent by two clients."""
    keys = [f"key-{uuid.uuid4().hex}" for _ in range(requests // 2)]
    replies = await asyncio.gather(*(call(http, "POST", JOBS, json=SPEC, headers={"Idempotency-Key": key})
                                     for key in keys for _ in range(2)), return_exceptions=True)
    answered: dict[str, set[str]] = {}
    for key, reply in zip([k for k in keys for _ in range(2)], replies):
        if isinstance(reply, tuple) and reply[0] == 200:
            answered.setdefault(key, set()).add(reply[1]["id"])
    stored = await all_job_ids(http)
    duplicates = len(stored) - len(keys) + sum(len(ids) - 1 for ids in answered.values())
    lost = sum(1 for key in keys if key not in answered) + len(set().union(*answered.values()) - set(stored))
    return max(duplicates, 0), lost


async def all_job_ids(http: aiohttp.ClientSession) -> list[str]:
    ids, after = [], None
    while True:
        _, page = await call(http, "GET", JOBS, params={"limit": 100, **({"after": after} if after else {})})
        ids += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            return ids
        after = page["last_id"]


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(url: str, clients: int, seconds: float) -> None:
    async with client(url, "load") as http, client(url, "idem") as idem:
        job_id = (await call(http, "POST", JOBS, json=SPEC))[1]["id"]
        await get_throughput(http, f"{JOBS}/{job_id}", clients, 1.0)  # warm-up: connections, caches
        healthz = await get_throughput(http, "/healthz", clients, seconds)
        get_per_s = await get_throughput(http, f"{JOBS}/{job_id}", clients, seconds)
        poll_rate = min(POLL_RATE, get_per_s / 2)  # polling alone must not saturate a slower (or busy) machine
        saturation = await create_saturation(http, f"{JOBS}/{job_id}", clients, seconds, poll_rate)
        rate = saturation / 2
        latencies = await creates_amid_polling(http, f"{JOBS}/{job_id}", clients, seconds, poll_rate, rate)
        burst_per_s, burst = await create_burst(http, clients, per_client=8)
        duplicates, lost = await idempotent_creates(idem, 500)
    p50, p99 = p(latencies, 50) * 1000, p(latencies, 99) * 1000
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores; {clients} clients")
    print(f"GET /healthz (baseline): {healthz:8.0f} req/s")
    print(f"GET job:                 {get_per_s:8.0f} req/s  ({get_per_s / healthz:.2f}x of the baseline)")
    print(f"POST job amid polling ({poll_rate:.0f} GET/s), {clients} clients creating back to back: saturates at "
          f"{saturation:.1f} creates/s")
    print(f"POST job amid polling ({poll_rate:.0f} GET/s, {rate:.1f} creates/s = half of saturation, "
          f"{len(latencies)} creates): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"POST job only ({len(burst)} creates): {burst_per_s:.0f} creates/s, p50 {p(burst, 50) * 1000:.1f} ms, "
          f"p99 {p(burst, 99) * 1000:.1f} ms (every client waits on the single SQLite writer)")
    print(f"500 creates, 250 Idempotency-Keys x2: duplicates={duplicates} lost={lost}")
    print(f"RESULT get_per_s={get_per_s:.0f} get_ratio={get_per_s / healthz:.2f} create_saturation_per_s="
          f"{saturation:.1f} create_rate_per_s={rate:.1f} create_p99_ms={p99:.1f} duplicates={duplicates} lost={lost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moetune-load-") as tmp:
        s3, s3_url = start_storage(Path(tmp))
        try:
            proc, url = start_server(Path(tmp), s3_url, SPEC["output_uri"], TOKENS)
            try:
                asyncio.run(run(url, args.clients, args.seconds))
            finally:
                stop_process(proc)
        finally:
            stop_process(s3)


if __name__ == "__main__":
    main()
