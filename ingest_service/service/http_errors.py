"""One JSON error shape for every route of the service, and the middleware that
makes it so.

``{"error": {"code": "<stable name>", "message": "<what, why, what to do>"}}``: an
:class:`~ingest_service.errors.AdminError` carries its status and code; aiohttp's own
HTTP errors (404 no route, 405 with its ``Allow`` header, 413) keep their status and
headers; Redis or a store out of reach is 503 with ``Retry-After``; anything else is
a 500 whose details stay in the service log.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web
from redis.exceptions import RedisError

from ingest_service.errors import AdminError

__all__ = ["RETRY_AFTER_S", "error_response", "json_errors", "unavailable"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
_KEPT_HEADERS = ("Allow", "Retry-After", "WWW-Authenticate")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, code: str, message: str,
                   headers: Mapping[str, str] | None = None,
                   details: Mapping[str, object] | None = None) -> web.Response:
    """The one error body; ``details`` adds fields beside code and message (a 409's
    ``mark``)."""
    out = dict(headers or {})
    if status == 401:
        out.setdefault("WWW-Authenticate", "Bearer")
    error: dict[str, object] = {"code": code, "message": message, **(details or {})}
    return web.json_response({"error": error}, status=status, headers=out or None)


def unavailable(exc: BaseException) -> web.Response:
    """503 for a backend out of reach. The message names the error's type and text;
    URLs are not in redis-py's connection errors (host and port are)."""
    return error_response(
        503, "backend_unavailable",
        f"Redis or a checkpoint store could not be reached ({type(exc).__name__}: {exc}); "
        "retry later, and check that it runs and that the service's URL points at it",
        {"Retry-After": str(RETRY_AFTER_S)},
    )


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except AdminError as exc:
        retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status in (429, 503) else None
        return error_response(exc.status, exc.code, str(exc), retry)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = (exc.reason or "http_error").lower().replace(" ", "_")
        kept = {k: exc.headers[k] for k in _KEPT_HEADERS if k in exc.headers}
        return error_response(exc.status, code, exc.text or exc.reason or code, kept)
    except (RedisError, OSError) as exc:
        return unavailable(exc)
    except Exception:
        log.exception("route %s %s failed", request.method, request.path)
        return error_response(500, "internal", "internal error; see the service log")
