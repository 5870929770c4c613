"""`moetune up` / `moetune down` N times in a row under load: every start must succeed (issue 55: one `make demo` in
five failed when the dashboard's port, chosen from the ephemeral range, was taken before Ray bound it).

The load: a busy process per core, and a client that opens and closes loopback connections without pause, so the
kernel hands out ephemeral ports (and leaves them in TIME_WAIT) all the time, as a machine busy with other work
does. Each cycle is a first `up` in a fresh state directory (S3 server, Ray head and control plane on newly chosen
ports) followed by `down`.

    python bench/stack_cycles.py [--cycles 20]

Last line: RESULT stack_cycles=<N> failures=<K> up_s_median=<s>
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    stop_spinning = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop_spinning,), daemon=True)
                for _ in range(os.cpu_count() or 1)]
    stop_churning = threading.Event()
    churn = threading.Thread(target=_churn_connections, args=(stop_churning,), daemon=True)
    for process in spinners:
        process.start()
    churn.start()
    failures, up_seconds = 0, []
    try:
        with tempfile.TemporaryDirectory(prefix="moetune-cycles-") as root:
            for cycle in range(1, args.cycles + 1):
                try:
                    up_seconds.append(_cycle(Path(root)))
                    print(f"cycle {cycle}: up in {up_seconds[-1]:.1f} s", flush=True)
                except Exception:  # a failed start is what this bench counts
                    failures += 1
                    print(f"cycle {cycle}: FAILED\n{traceback.format_exc()}", flush=True)
    finally:
        stop_spinning.set()
        stop_churning.set()
        for process in spinners:
            process.join(5)
    median = statistics.median(up_seconds) if up_seconds else float("nan")
    print(f"RESULT stack_cycles={args.cycles} failures={failures} up_s_median={median:.1f}")


if __name__ == "__main__":
    main()
