"""The web console in a real browser: Debian's chromium, headless, driven by Playwright (never a downloaded
browser). Every request the page makes is recorded (URL and method), and so is every console message of level
error and every uncaught exception; screenshots go to the test's folder and their paths are printed."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.browser import chromium

DESKTOP = {"width": 1280, "height": 800}
NARROW = {"width": 390, "height": 800}
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
# Chromium logs each answer >= 400 a page's fetch gets ("Failed to load resource: ... status of 422"); the tests
# cause some on purpose (a refused upload, a field error), so those are told apart from real errors by status.
_FAILED_LOAD = re.compile(r"Failed to load resource: the server responded with a status of (\d+)")


@dataclass
class Session:
    page: object  # playwright.sync_api.Page
    shots: Path
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, URL)
    errors: list[str] = field(default_factory=list)  # console errors and uncaught exceptions
    failed_statuses: list[int] = field(default_factory=list)  # HTTP statuses of the failed loads Chromium logged

    def shot(self, name: str, viewport: dict | None = None) -> Path:
        """A full-page screenshot (at `viewport`, then back to the desktop size); the page must not scroll sideways."""
        if viewport:
            self.page.set_viewport_size(viewport)
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        overflow = self.page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        if viewport:
            self.page.set_viewport_size(DESKTOP)
        print(f"screenshot {path}")
        assert overflow <= 0, f"{name}: the page is {overflow}px wider than the window"
        return path

    def off_loopback(self) -> list[str]:
        return [url for _, url in self.requests if urlsplit(url).hostname not in LOOPBACK
                and not url.startswith(("data:", "about:", "blob:"))]


@contextmanager
def console_session(shots: Path) -> Iterator[Session]:
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            context = browser.new_context(viewport=DESKTOP)
            page = context.new_page()
            session = Session(page, shots)
            context.on("request", lambda r: session.requests.append((r.method, r.url)))

            def on_console(message):
                if message.type != "error":
                    return
                failed = _FAILED_LOAD.search(message.text)
                if failed:
                    session.failed_statuses.append(int(failed.group(1)))
                else:
                    session.errors.append(f"console: {message.text} at {message.location}")

            page.on("console", on_console)
            page.on("pageerror", lambda error: session.errors.append(f"uncaught: {error}"))
            page.set_default_timeout(30_000)
            yield session
        finally:
            browser.close()
