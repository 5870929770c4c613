"""A real HTTP receiver of webhooks on loopback: it checks every delivery with the official `openai` SDK's
verification (client.webhooks.unwrap with the endpoint's secret) and refuses the first tries of each event id.
tests/service/test_webhooks.py and bench/cluster_faults.py run it."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from openai import InvalidWebhookSignatureError, OpenAI

from moetune.service.local.embedded import free_port

_OPENAI = OpenAI(api_key="unused", base_url="http://127.0.0.1:9")  # only its webhook verification is used


@dataclass
class Route:
    """What one receiver path does: refuses the first `fail_first` tries of each event id with a 503."""

    fail_first: int = 0
    secret: str = ""
    tries: Counter = field(default_factory=Counter)
    accepted: dict = field(default_factory=dict)  # event id -> the verified events it accepted
    forged: int = 0


class Receiver:
    def __init__(self):
        self.routes: dict[str, Route] = {}
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                self.send_response(receiver.answer(self.path, body, dict(self.headers.items())))
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def answer(self, path: str, body: bytes, headers: dict) -> int:
        route = self.routes[path]
        with self.changed:
            try:
                event = _OPENAI.webhooks.unwrap(body, headers, secret=route.secret)
            except InvalidWebhookSignatureError:
                route.forged += 1
                return 400
            route.tries[event.id] += 1
            self.changed.notify_all()
            if route.tries[event.id] <= route.fail_first:
                return 503
            route.accepted.setdefault(event.id, []).append(json.loads(body))
            return 200

    def wait(self, done: Callable[[], bool], timeout: float = 30) -> None:
        with self.changed:
            assert self.changed.wait_for(done, timeout), {p: (r.tries, dict(r.accepted)) for p, r in self.routes.items()}


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A Receiver serving from a background thread until the block ends."""
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
