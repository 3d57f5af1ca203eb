"""Browser helpers of the dashboard tests: Debian's chromium driven by playwright
(never playwright's own browser downloads), pages opened and read the way an operator
sees them, console errors collected, screenshots saved.

``TRAINGUARD_SCREENSHOT_DIR``: when set, the run page's screenshot is also written
there (that is how README's ``docs/dashboard-run.png`` is made).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHROMIUM = os.environ.get("TRAINGUARD_CHROMIUM", "/usr/bin/chromium")
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def chromium_path() -> str:
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        raise RuntimeError(
            f"no chromium at {CHROMIUM}: the browser tests drive Debian's chromium. "
            "Run `make setup` as root (it installs it), or `apt-get install chromium`, "
            "or point TRAINGUARD_CHROMIUM at a Chromium binary")
    return CHROMIUM if os.path.exists(CHROMIUM) else str(shutil.which("chromium"))


@contextmanager
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium_path(),
                               args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


class Page:
    """One tab at one viewport, recording every console error and page error."""

    def __init__(self, browser_: Any, base_url: str, viewport: dict[str, int],
                 errors: list[str]) -> None:
        self.context = browser_.new_context(viewport=viewport)
        self.page = self.context.new_page()
        self.base_url = base_url
        self.viewport = viewport
        self.page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}")
                     if m.type == "error" else None)
        self.page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

    def open(self, fragment: str) -> None:
        """Go to ``/ui#<fragment>`` (a hash change when already on /ui: no reload)."""
        if self.page.url.startswith(f"{self.base_url}/ui"):
            self.page.evaluate("f => { location.hash = f; }", fragment)
        else:
            self.page.goto(f"{self.base_url}/ui#{fragment}")
        self.fresh_render()

    def rendered(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.loaded || 0)"))

    def wait_until(self, expression: str, timeout_ms: int = 30_000) -> Any:
        """Poll the JS ``expression`` until it is truthy. (Not wait_for_function: that
        evaluates a string inside the page, which the page's CSP forbids.)"""
        for _ in range(timeout_ms // 100):
            value = self.page.evaluate(expression)
            if value:
                return value
            self.page.wait_for_timeout(100)
        raise AssertionError(f"not true within {timeout_ms} ms: {expression}")

    def fresh_render(self, timeout_ms: int = 30_000) -> None:
        """Wait until a redraw that began after now has finished (the page polls)."""
        n = self.rendered()
        self.wait_until(f"Number(document.body.dataset.loaded || 0) >= {n + 2}", timeout_ms)

    def value(self, selector: str) -> str | None:
        """The raw value (data-v) of the element ``selector`` names."""
        return self.page.locator(selector).first.get_attribute("data-v")

    def values(self, scope: str) -> dict[str, str]:
        """Every data-k -> data-v inside the elements ``scope`` names (first wins)."""
        pairs = self.page.eval_on_selector_all(
            f"{scope} [data-k]", "els => els.map(e => [e.dataset.k, e.dataset.v])")
        out: dict[str, str] = {}
        for k, v in pairs:
            out.setdefault(k, v)
        return out

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def overflow_px(self) -> int:
        """How far the page is wider than the viewport (0: nothing cut off sideways)."""
        return int(self.page.evaluate(
            "document.documentElement.scrollWidth - window.innerWidth"))

    def close(self) -> None:
        self.context.close()


def same(shown: str | None, api: Any) -> bool:
    """A value shown by the page (data-v text) equals the API's value."""
    if api is None:
        return shown in (None, "")
    if isinstance(api, bool):
        return shown == ("1" if api else "0")
    if isinstance(api, (int, float)):
        return shown is not None and shown != "" and float(shown) == float(api)
    return shown == str(api)
