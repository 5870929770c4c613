"""Control-plane memory during a large upload: 1 GB of valid JSONL sent to `POST /v1/files` of a real `moetune
server` process (uvicorn, SQLite, a moto S3 server for the files), generated as it is sent. The server's resident
memory is sampled every 50 ms; its growth is the peak during the upload (and until the answer) minus the level
after a small warm-up upload (imports, first connections). An upload that streams stays near one storage part and
one check piece whatever the file's size; one that holds the file grows by its size.

    python bench/upload_memory.py [--gb 1.0]

Ends with `RESULT upload_bytes=<n> rss_growth_mib=<m> seconds=<s> mb_per_s=<r>` (goal: rss_growth_mib < 64).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import psutil

from moetune.service.local.embedded import free_port, s3_env, spawn_s3_server, stop_process

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench.support
from bench.support.server_process import start_server  # noqa: E402

TOKEN = "tok-bench"
BUCKET = "bench-files"
BOUNDARY = "moetune-bench-boundary"
MIB = 2**20


def jsonl_pieces(total: int) -> Iterator[bytes]:
    """`total` bytes (rounded down to whole rows) of valid rows of both kinds, one MiB-sized piece at a time."""
    rows = b"".join((json.dumps({"text": f"row {i}: " + "tokens " * 40}) + "\n").encode() for i in range(200)) + (
        json.dumps({"messages": [{"role": "user", "content": "hi " * 30},
                                 {"role": "assistant", "content": "hello " * 30}]}) + "\n").encode()
    piece = rows * max(1, MIB // len(rows))
    for _ in range(total // len(piece)):
        yield piece


def multipart(pieces: Iterator[bytes], filename: str) -> Iterator[bytes]:
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
           f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n\r\n').encode()
    yield from pieces
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


class PeakRss:
    """The highest resident set size of a process, sampled in a thread."""

    def __init__(self, pid: int, every_s: float = 0.05):
        self._process, self._every_s = psutil.Process(pid), every_s
        self.peak = self._process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self._every_s):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def upload(http: httpx.Client, total: int, filename: str) -> tuple[dict, int]:
    """The stored file's description and the bytes of JSONL sent."""
    sent = 0

    def counted() -> Iterator[bytes]:
        nonlocal sent
        for piece in jsonl_pieces(total):
            sent += len(piece)
            yield piece

    response = http.post("/v1/files", content=multipart(counted(), filename),
                         headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert response.status_code == 200, response.text
    return response.json(), sent


def run(url: str, pid: int, total: int) -> None:
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
        upload(http, 16 * MIB, "warm-up.jsonl")  # imports, S3 clients, the SQLite file: not the upload's cost
        baseline = psutil.Process(pid).memory_info().rss
        start = time.perf_counter()
        with PeakRss(pid) as rss:
            stored, sent = upload(http, total, "big.jsonl")
        seconds = time.perf_counter() - start
    assert stored["bytes"] == sent, (stored, sent)
    growth = (rss.peak - baseline) / MIB
    print(f"baseline rss {baseline / MIB:.0f} MiB, peak {rss.peak / MIB:.0f} MiB, {stored['rows']} rows stored")
    print(f"RESULT upload_bytes={sent} rss_growth_mib={growth:.1f} seconds={seconds:.1f} "
          f"mb_per_s={sent / seconds / 1e6:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="JSONL to upload, in GB (10**9 bytes)")
    args = parser.parse_args()
    total = int(args.gb * 1e9)
    with tempfile.TemporaryDirectory(prefix="moetune-upload-") as tmp:
        port = free_port()
        s3 = spawn_s3_server(port, str(Path(tmp) / "s3.log"))
        s3_url = f"http://127.0.0.1:{port}"
        try:
            os.environ.update(s3_env(s3_url))
            boto3.client("s3", endpoint_url=s3_url).create_bucket(Bucket=BUCKET)  # /readyz checks the outputs' bucket
            proc, url = start_server(Path(tmp), s3_url, f"s3://{BUCKET}/runs", {"bench": TOKEN},
                                     max_upload_mb=str(total / 1e6 + 100))
            try:
                run(url, proc.pid, total)
            finally:
                stop_process(proc)
        finally:
            stop_process(s3)


if __name__ == "__main__":
    main()
