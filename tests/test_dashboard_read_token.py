"""The dashboard against a service with a read token, in Debian's chromium.

Property: with ``TRAINGUARD_READ_TOKEN`` set, the dashboard opened without a token
says that the service needs its read token and where to set it (not a bare
"unauthorized"), and once the read token is set in the footer's field the overview
shows the dataset the API lists, with every read sent with that token.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ingest_service.service.admin import AdminConfig
from tests import _client_fill as cf
from tests._dashboard import DESKTOP, Page, browser
from tests.admin_helpers import TOKEN, ThreadedServer, service_app
from tests.servers import RedisServer

READ = "dashboard-read-token-0123456789"


@pytest.mark.slow
def test_the_dashboard_asks_for_the_read_token_and_shows_the_pages_with_it(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """Without a token: the page's error names the read token and the "set token"
    field; with the read token entered there: the overview lists the dataset, and no
    console error beyond the 401 answers of the first try."""
    cf.create(redis_server.url, "tok", partitions=2)
    server = ThreadedServer(service_app(
        AdminConfig(redis_server.url, TOKEN, {}, read_token=READ))).start()
    errors: list[str] = []
    try:
        with browser() as b:
            page = Page(b, server.url, DESKTOP, errors)
            page.page.goto(f"{server.url}/ui#/")
            message = page.wait_until(
                "(document.querySelector('[data-k=error]') || {}).textContent")
            assert "read token" in message and "set token" in message, message
            page.page.on("dialog", lambda d: d.accept(READ))
            page.page.click("#token-btn")
            page.wait_until("document.querySelector('a[href=\"#/dataset/tok\"]') !== null")
            assert page.page.locator("[data-k=error]").count() == 0
            assert page.page.evaluate("sessionStorage.getItem('trainguard-token')") == READ
            page.close()
    finally:
        server.stop()
    assert all("401" in e or "Unauthorized" in e for e in errors), errors
