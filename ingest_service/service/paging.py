"""Pages of long read answers, and read work that stops when its client has gone.

``?offset=K&limit=N`` selects rows ``[K, K + N)`` of a listing; the answer says
``total``, so a client pages until ``offset + limit >= total``. :func:`until_gone`
runs a read's work as a task and cancels it when the client closes its connection
(aiohttp leaves a handler running after a disconnect): the catalog work it waits for
then stops between two manifests (:class:`ingest_service.service.catalog.Flights`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web

from ingest_service.errors import BadRequest

__all__ = ["MAX_LIMIT", "page", "until_gone"]

MAX_LIMIT = 1000
"""The most rows one page holds."""
GONE_POLL_S = 0.25

T = TypeVar("T")


def _count(request: web.Request, name: str, default: int, top: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    # At most top's digits before int(): a long digit string is refused uncounted (and
    # top itself, 10 digits for offset's 10**9, is the spec's maximum: accepted).
    if (not text.isascii() or not text.isdigit() or len(text) > len(str(top))
            or int(text) > top):
        raise BadRequest(f"bad_{name}", f"?{name}={text[:20]!r} is not valid: expected an "
                                        f"integer from 0 to {top}")
    return int(text)


def page(request: web.Request, *, default_limit: int) -> tuple[int, int]:
    """``(offset, limit)`` from the query (400 for anything but integers in range)."""
    limit = _count(request, "limit", default_limit, MAX_LIMIT)
    return _count(request, "offset", 0, 10**9), max(limit, 1)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def until_gone(request: web.Request, work: Coroutine[Any, Any, T]) -> T:
    """``await work``, cancelled as soon as the request's client has disconnected
    (then this raises CancelledError: there is no one to answer)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=GONE_POLL_S)
            if done:
                return task.result()
            if _gone(request):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise asyncio.CancelledError
    except asyncio.CancelledError:
        task.cancel()
        raise
