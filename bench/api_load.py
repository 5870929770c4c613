"""Control-plane load: 64 concurrent clients against a real `moetune server` (uvicorn, SQLite).

Measures GET throughput on a job (baseline: /healthz on the same server, i.e. the HTTP stack's ceiling),
create latency (p50/p99) and 500 concurrent creates with Idempotency-Key (every key sent twice at once):
no key may end up with two jobs (duplicates) or none (lost).

    python bench/api_load.py [--clients 64] [--seconds 5]

The scheduler is off: this measures the API, not Ray. Ends with
`RESULT get_per_s=<x> create_p99_ms=<y> duplicates=<n> lost=<m>`.
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

import httpx

from service.embedded import free_port, stop_process, wait_http

JOBS = "/v1/fine_tuning/jobs"
SPEC = {"model": "s3://models/tiny", "training_file": "s3://data/train.jsonl"}
TOKENS = {"load": "tok-load", "idem": "tok-idem"}


def start_server(work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ,
           "MOETUNE_DATABASE_URL": f"sqlite:///{work / 'moetune.db'}",
           "MOETUNE_API_TOKENS": ",".join(f"{tok}:{tenant}" for tenant, tok in TOKENS.items()),
           "MOETUNE_SCHEDULER_ENABLED": "false"}
    log = open(work / "server.log", "w")
    moetune = Path(sys.executable).with_name("moetune")
    proc = subprocess.Popen([str(moetune), "server", "--port", str(port), "--log-level", "warning"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/readyz", 60, proc, str(work / "server.log"))
    return proc, url


def client(url: str, tenant: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKENS[tenant]}"}, timeout=60,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def get_throughput(http: httpx.AsyncClient, path: str, clients: int, seconds: float) -> float:
    """Requests per second that all `clients` loops complete for `seconds`; every answer must be a 200."""
    deadline = time.perf_counter() + seconds
    done = 0

    async def loop():
        nonlocal done
        while time.perf_counter() < deadline:
            response = await http.get(path)
            assert response.status_code == 200, response.text
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return done / (time.perf_counter() - start)


async def create_latencies(http: httpx.AsyncClient, clients: int, per_client: int) -> list[float]:
    latencies: list[float] = []

    async def loop():
        for _ in range(per_client):
            start = time.perf_counter()
            response = await http.post(JOBS, json=SPEC)
            latencies.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text

    await asyncio.gather(*(loop() for _ in range(clients)))
    return latencies


async def idempotent_creates(http: httpx.AsyncClient, requests: int) -> tuple[int, int]:
    """(duplicates, lost) after `requests` concurrent creates, each Idempotency-Key sent by two clients."""
    keys = [f"key-{uuid.uuid4().hex}" for _ in range(requests // 2)]
    replies = await asyncio.gather(*(http.post(JOBS, json=SPEC, headers={"Idempotency-Key": key})
                                     for key in keys for _ in range(2)), return_exceptions=True)
    answered: dict[str, set[str]] = {}
    for key, reply in zip([k for k in keys for _ in range(2)], replies):
        if isinstance(reply, httpx.Response) and reply.status_code == 200:
            answered.setdefault(key, set()).add(reply.json()["id"])
    stored = await all_job_ids(http)
    duplicates = len(stored) - len(keys) + sum(len(ids) - 1 for ids in answered.values())
    lost = sum(1 for key in keys if key not in answered) + len(set().union(*answered.values()) - set(stored))
    return max(duplicates, 0), lost


async def all_job_ids(http: httpx.AsyncClient) -> list[str]:
    ids, after = [], None
    while True:
        page = (await http.get(JOBS, params={"limit": 100, **({"after": after} if after else {})})).json()
        ids += [job["id"] for job in page["data"]]
        if not page["has_more"]:
            return ids
        after = page["last_id"]


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def run(url: str, clients: int, seconds: float) -> None:
    async with client(url, "load") as http, client(url, "idem") as idem:
        job_id = (await http.post(JOBS, json=SPEC)).json()["id"]
        await get_throughput(http, f"{JOBS}/{job_id}", clients, 1.0)  # warm-up: connections, caches
        healthz = await get_throughput(http, "/healthz", clients, seconds)
        get_per_s = await get_throughput(http, f"{JOBS}/{job_id}", clients, seconds)
        latencies = await create_latencies(http, clients, per_client=8)
        duplicates, lost = await idempotent_creates(idem, 500)
    p50, p99 = p(latencies, 50) * 1000, p(latencies, 99) * 1000
    print(f"load average: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores; {clients} clients")
    print(f"GET /healthz (baseline): {healthz:8.0f} req/s")
    print(f"GET job:                 {get_per_s:8.0f} req/s  ({get_per_s / healthz:.2f}x of the baseline)")
    print(f"POST job ({len(latencies)}): p50 {p50:.1f} ms, p99 {p99:.1f} ms")
    print(f"500 creates, 250 Idempotency-Keys x2: duplicates={duplicates} lost={lost}")
    print(f"RESULT get_per_s={get_per_s:.0f} create_p99_ms={p99:.1f} duplicates={duplicates} lost={lost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moetune-load-") as tmp:
        proc, url = start_server(Path(tmp))
        try:
            asyncio.run(run(url, args.clients, args.seconds))
        finally:
            stop_process(proc)


if __name__ == "__main__":
    main()
