"""Debian's chromium, headless, opening a page through a logging proxy: every request (the page itself included,
loopback too) reaches the proxy, which serves only the page and records each request with its Referer: the page's
own requests carry the page's URL there, the browser's background requests (its clock, its account service) none."""

from __future__ import annotations

import shutil
import subprocess
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

PAGE_URL = "http://report.moetune.test/report.html"  # no such host: only the proxy answers for it


@dataclass
class Opened:
    dom: str  # the DOM after load (--dump-dom)
    screenshot: Path
    requests: list[tuple[str, str | None]]  # (absolute URL, or CONNECT host:port for TLS; its Referer)

    def from_page(self) -> list[str]:
        return [url for url, referer in self.requests if referer and referer.startswith(PAGE_URL)]

    def of_page(self) -> list[str]:
        return [url for url, _ in self.requests if url == PAGE_URL]


def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("`chromium` not found: install Debian's `chromium` package (.ci/run does)")
    return path


def open_page(html: bytes, tmp_path: Path, width: int = 1200, height: int = 4000) -> Opened:
    requests: list[tuple[str, str | None]] = []

    class Proxy(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            requests.append((self.path, self.headers.get("Referer")))
            found = self.path == PAGE_URL
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            body = html if found else b""
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_CONNECT(self):  # noqa: N802
            requests.append((f"CONNECT {self.path}", self.headers.get("Referer")))
            self.send_response(403)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shot = tmp_path / "page.png"
    flags = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--mute-audio",
             f"--user-data-dir={tmp_path / 'profile'}", f"--proxy-server=http://127.0.0.1:{server.server_port}",
             f"--window-size={width},{height}", "--hide-scrollbars",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    try:
        subprocess.run([*flags, f"--screenshot={shot}", PAGE_URL], check=True, capture_output=True, timeout=120)
        dom = subprocess.run([*flags, "--dump-dom", PAGE_URL], check=True, capture_output=True, text=True,
                             timeout=120).stdout
    finally:
        server.shutdown()
        server.server_close()
    return Opened(dom, shot, requests)
