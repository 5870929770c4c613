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

DESKTOP = {"width": 1400, "height": 900}
NARROW = {"width": 420, "height": 900}
READABLE_PX = 11  # the smallest chart label a person reads without zooming
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

    def both_widths(self, name: str) -> None:
        """Screenshots at the desktop and the narrow width, each checked for layout faults (see layout_faults)."""
        for suffix, viewport in (("", None), ("-narrow", NARROW)):
            if viewport:
                self.page.set_viewport_size(viewport)
            self.page.evaluate("new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)))")
            faults = layout_faults(self.page)
            self.shot(name + suffix)
            if viewport:
                self.page.set_viewport_size(DESKTOP)
            assert faults == [], f"{name}{suffix}: {faults}"

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


# What a person meets as broken layout, measured in the page: chart labels under READABLE_PX as drawn, chart ticks
# that are not round (1, 2 or 5 times a power of ten apart), an id (class "id", the page's heading) broken over lines,
# a table wider than its scroll box's visible part without that box scrolling, or a box reaching past the window.
_LAYOUT_FAULTS = """(readable) => {
  const faults = [];
  for (const svg of document.querySelectorAll(".chart svg")) {
    const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
    for (const text of svg.querySelectorAll("text")) {
      const px = parseFloat(getComputedStyle(text).fontSize) * scale;
      if (px < readable) faults.push(`chart label "${text.textContent}" is ${px.toFixed(1)} px`);
    }
    for (const axis of ["x", "y"]) {
      const values = [...svg.querySelectorAll(`text.tick.${axis}`)].map((t) => Number(t.textContent));
      const step = values[1] - values[0];
      const mantissa = step / 10 ** Math.floor(Math.log10(step));
      const round = values.length < 2 || ([1, 2, 5].some((m) => Math.abs(mantissa - m) < 1e-6)
        && values.every((v, i) => Math.abs(v - values[0] - i * step) < step * 1e-6)
        && values.every((v) => Math.abs(v / step - Math.round(v / step)) < 1e-6));
      if (!round) faults.push(`${axis} ticks not round: ${values}`);
    }
  }
  for (const el of document.querySelectorAll(".id, h1")) {
    const range = document.createRange();
    range.selectNodeContents(el);
    const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
    if (lines.size > 1) faults.push(`"${el.textContent}" is on ${lines.size} lines`);
  }
  const right = document.documentElement.clientWidth;
  for (const box of document.querySelectorAll(".scroll, .card")) {
    const edge = box.getBoundingClientRect().right;
    if (edge > right + 0.5) faults.push(`${box.className} ${box.firstElementChild?.id || ""} ends at ${edge}px of ${right}`);
    const scrolls = ["auto", "scroll"].includes(getComputedStyle(box).overflowX);
    if (box.classList.contains("scroll") && box.scrollWidth > box.clientWidth && !scrolls) faults.push(`${box.firstElementChild?.id} cropped`);
  }
  return faults;
}"""


def layout_faults(page) -> list[str]:
    return page.evaluate(_LAYOUT_FAULTS, READABLE_PX)


def tick_labels(page, chart: str, axis: str) -> list[str]:
    return [el.text_content() for el in page.query_selector_all(f"{chart} svg text.tick.{axis}")]
