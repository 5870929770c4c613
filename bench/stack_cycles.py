"""`moetune up` / `moetune down` N times in a row under load, then `make demo`'s stack started and stopped M times:
every start must succeed (issue 55: one `make demo` in five failed when the dashboard's port, chosen from the
ephemeral range, was taken before Ray bound it).

The load: a busy process per core, and a client that opens and closes loopback connections without pause, so the
kernel hands out ephemeral ports (and leaves them in TIME_WAIT) all the time, as a machine busy with other work
does. Each cycle is a first `up` in a fresh state directory (S3 server, Ray head and control plane on newly chosen
ports) followed by `down`. Each demo start is `moetune demo`'s stack up to its first request (S3 server with the
generated checkpoint, Ray head, the control plane served in this process; service.local.demo.demo_stack).

    python bench/stack_cycles.py [--cycles 20] [--demo-starts 5]

Last line: RESULT stack_cycles=<N> failures=<K> up_s_median=<s> demo_starts=<M> demo_failures=<J>
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
import traceback
from pathlib import Path

import httpx

from moetune.service.local import stack as local_stack


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def _churn_connections(stop: threading.Event) -> None:
    """Outgoing loopback connections, one after another: each takes a port from the ephemeral range."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        threading.Thread(target=_accept_and_close, args=(listener, stop), daemon=True).start()
        while not stop.is_set():
            try:
                socket.create_connection(listener.getsockname(), timeout=1).close()
            except OSError:  # ports exhausted for a moment: the point of the exercise
                time.sleep(0.01)


def _accept_and_close(listener: socket.socket, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            listener.accept()[0].close()
        except OSError:
            return


def _cycle(root: Path) -> float:
    state_dir = Path(tempfile.mkdtemp(prefix="cycle-", dir=root))
    started = time.monotonic()
    try:
        local_stack.up(state_dir)
        return time.monotonic() - started
    finally:
        local_stack.down(state_dir)


def _demo_start(root: Path) -> float:
    from rich.console import Console

    from moetune.service.local.demo import demo_stack

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="demo-", dir=root) as work, \
            demo_stack(Path(work), False, Console(quiet=True)) as (_, url, _head):
        httpx.get(f"{url}/healthz", timeout=10).raise_for_status()
        return time.monotonic() - started


def _attempts(name: str, count: int, attempt) -> tuple[int, list[float]]:
    """(failures, seconds of each success) of `count` calls of `attempt`, each line printed."""
    failures, seconds = 0, []
    for number in range(1, count + 1):
        try:
            seconds.append(attempt())
            print(f"{name} {number}: up in {seconds[-1]:.1f} s", flush=True)
        except Exception:  # a failed start is what this bench counts
            failures += 1
            print(f"{name} {number}: FAILED\n{traceback.format_exc()}", flush=True)
    return failures, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--demo-starts", type=int, default=5)
    args = parser.parse_args()
    stop_spinning = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop_spinning,), daemon=True)
                for _ in range(os.cpu_count() or 1)]
    stop_churning = threading.Event()
    churn = threading.Thread(target=_churn_connections, args=(stop_churning,), daemon=True)
    for process in spinners:
        process.start()
    churn.start()
    try:
        with tempfile.TemporaryDirectory(prefix="moetune-cycles-") as root:
            failures, up_seconds = _attempts("cycle", args.cycles, lambda: _cycle(Path(root)))
            demo_failures, _ = _attempts("demo start", args.demo_starts, lambda: _demo_start(Path(root)))
    finally:
        stop_spinning.set()
        stop_churning.set()
        for process in spinners:
            process.join(5)
    median = statistics.median(up_seconds) if up_seconds else float("nan")
    print(f"RESULT stack_cycles={args.cycles} failures={failures} up_s_median={median:.1f} "
          f"demo_starts={args.demo_starts} demo_failures={demo_failures}")


if __name__ == "__main__":
    main()
