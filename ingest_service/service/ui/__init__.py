"""The operator's dashboard: static HTML, CSS and JS served at ``/ui``.

No build step and no third-party code: the page is ``static/index.html`` with
``app.js`` (a hash router, polling the read-only JSON routes of
:mod:`ingest_service.service.runs` and :mod:`ingest_service.service.admin` every two seconds, charts
drawn as plain SVG) and ``app.css``. Reading needs no token; the mutations the page
offers (pin/unpin a checkpoint, clear a node's quarantine) send the admin token the
operator types in, which is kept in the tab's sessionStorage only.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

__all__ = ["STATIC_DIR", "setup_ui"]

STATIC_DIR = Path(__file__).parent / "static"


# Only the page's own files, no inline script or style, no framing: names in the data
# are shown as text, and even a mistake there could not run code or load anything.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


async def _index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers={
        "Cache-Control": "no-cache", "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})


def setup_ui(app: web.Application) -> None:
    """Serve the dashboard at ``/ui`` (its files under ``/ui/static/``)."""
    app.router.add_get("/ui", _index)
    app.router.add_static("/ui/static/", STATIC_DIR, append_version=False)
