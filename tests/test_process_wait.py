"""Waiting until a started server answers has one home (``trainguard.core.process``),
which the demo, ``tests/servers.py`` and the push benchmark call."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from trainguard.core.process import free_port, http_ready, wait_until


class _Ready(http.server.BaseHTTPRequestHandler):
    ready = False

    def do_GET(self) -> None:
        self.send_response(200 if type(self).ready and self.path == "/readyz" else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        _Ready.ready = False


def test_http_ready_is_true_only_for_a_200(server: str) -> None:
    """A 503, a path that is not served and a port nobody listens on are all "not
    ready"; the same URL is ready once it answers 200."""
    assert not http_ready(f"{server}/readyz")
    assert not http_ready(f"http://127.0.0.1:{free_port()}/readyz")
    _Ready.ready = True
    assert http_ready(f"{server}/readyz")
    assert not http_ready(f"{server}/other")


def test_wait_until_returns_when_the_check_passes_and_reports_a_timeout() -> None:
    """It calls the check until it passes (True, after exactly the calls it took), gives
    up with False when it never does, and lets a check's exception (the process it
    waits for exited) end the wait."""
    calls: list[int] = []

    def third() -> bool:
        calls.append(1)
        return len(calls) == 3

    assert wait_until(third, timeout_s=60, interval_s=0.001)
    assert len(calls) == 3
    assert not wait_until(lambda: False, timeout_s=0.05, interval_s=0.01)

    def exited() -> bool:
        raise RuntimeError("exited")

    with pytest.raises(RuntimeError, match="exited"):
        wait_until(exited, timeout_s=60)
