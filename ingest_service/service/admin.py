"""The admin HTTP API: datasets, consumer groups, offsets and checkpoints.

``setup_admin(app)`` adds the routes below to the ingest service's aiohttp app, plus
``/openapi.json`` (the document in :mod:`ingest_service.service.openapi`, which a test keeps
equal to the router). Reads go through :mod:`ingest_service.inspection` (Redis) and
:class:`checkpoint_store.CheckpointStore` (one per configured root).

Errors under ``/admin/`` and ``/openapi.json`` are JSON of one shape,
``{"error": {"code": "<stable name>", "message": "<what, why, what to do>"}}``:
400 malformed input, 401 no bearer token, 403 wrong token or mutations disabled,
404 unknown dataset/group/store/checkpoint, 409 refused in the current state,
413 body too large, 503 Redis or a store unreachable.

Readiness: the ingest app's ``/readyz`` checks Redis; with checkpoint stores
configured, a middleware here makes it also check that every store root answers
(503 naming the failing store otherwise).

Configuration (environment, read when the app is created): ``TRAINGUARD_ADMIN_TOKEN``
and ``TRAINGUARD_CHECKPOINT_STORES`` = ``name=url[|remote_url],...`` (see
:mod:`ingest_service.service.admin_checkpoints`).

Security: routes that change state (seek, pin, unpin, delete) need
``Authorization: Bearer <token>``, compared in constant time with the token from
``TRAINGUARD_ADMIN_TOKEN``. Without a configured token they are refused (403), never
open. Reads are open, but show names and figures only: a dataset's source and a
store's URLs are shown (credentials redacted) to a reader presenting the admin token.
``/verify`` runs in threads of its own, a bounded number at once (429 with
``Retry-After`` beyond), so readiness checks never wait behind it. Binding to
127.0.0.1 by default is the service's job (``trainguard serve``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from aiohttp import web

from ingest_service import inspection, redis_client, seek
from ingest_service.errors import BadRequest, Forbidden, Unauthorized
from ingest_service.service.admin_checkpoints import StoreRoot, StoreSet, parse_store_roots
from ingest_service.service.auth import bearer_token, check_secret, tokens_equal
from ingest_service.service.http_errors import json_errors
from ingest_service.service.openapi import openapi_document
from ingest_service.service.paging import page, until_gone
from trainguard.core import settings
from trainguard.core.urls import redact_url, redact_values

__all__ = [
    "ADMIN_CONFIG",
    "READ_REDIS_KEY",
    "STORES_KEY",
    "AdminConfig",
    "StoreRoot",
    "setup_admin",
]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AdminConfig:
    """What the admin routes need. ``stores`` maps a store name (used in URLs) to
    its root; ``token`` of None disables every mutating route."""

    redis_url: str
    token: str | None = None
    stores: Mapping[str, StoreRoot] = field(default_factory=dict)
    read_token: str | None = None
    """When set, every read route needs it (or the admin token) as a bearer token."""

    @classmethod
    def from_env(cls, redis_url: str | None = None) -> AdminConfig:
        """``TRAINGUARD_ADMIN_TOKEN``, ``TRAINGUARD_CHECKPOINT_STORES``
        (``name=url[|remote_url],...``), ``TRAINGUARD_TIER_SERVERS``
        (:mod:`~ingest_service.service.tier_places`) and, unless given,
        ``TRAINGUARD_REDIS_URL``.
        Raises TokenConfigError for a token that is set but blank or short."""
        token = settings.admin_token()
        if token is not None:
            check_secret(settings.ADMIN_TOKEN_ENV, token)
        read = settings.read_token()
        if read is not None:
            check_secret(settings.READ_TOKEN_ENV, read)
        return cls(settings.redis_url(redis_url), token,
                   parse_store_roots(settings.checkpoint_stores(), settings.tier_servers()),
                   read)


ADMIN_CONFIG = web.AppKey("trainguard_admin_config", AdminConfig)
_REDIS = web.AppKey("trainguard_admin_redis", aioredis.Redis)
_REDIS_MUTATIONS = web.AppKey("trainguard_admin_redis_mutations", aioredis.Redis)
READ_REDIS_KEY = _REDIS
"""The admin reads' Redis client (a pool that queues), for other read-route modules."""
READ_CONNECTIONS = 64
MUTATION_CONNECTIONS = 16
POOL_QUEUE_TIMEOUT_S = 10.0
"""How long a request waits for a free Redis connection before its 503."""
_STORES = web.AppKey("trainguard_admin_stores", StoreSet)
STORES_KEY = _STORES
"""The configured checkpoint stores, for other route modules (run history)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# --------------------------------------------------------------------------- plumbing


@web.middleware
async def _ready_with_stores(request: web.Request, handler: Handler) -> web.StreamResponse:
    """``/readyz`` (the ingest app's route, which checks Redis) is ready only when
    every configured checkpoint store answers too: a 200 becomes a 503 naming the
    stores that fail. The store answers are added to the JSON body as ``stores``."""
    response = await handler(request)
    stores = request.app[_STORES]
    if request.path != "/readyz" or not stores.roots or not isinstance(response, web.Response):
        return response
    try:
        verdicts = await asyncio.wait_for(stores.ready(), READY_TIMEOUT_S)
    except TimeoutError:
        verdicts = {name: f"no answer within {READY_TIMEOUT_S} s" for name in stores.roots}
    failing = {name: why for name, why in verdicts.items() if why != "ok"}
    try:
        body = json.loads(response.body) if isinstance(response.body, bytes) else {}
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    body["stores"] = verdicts
    if response.status == 200 and failing:
        body.update(ready=False, reason="checkpoint stores unreachable: " + "; ".join(
            f"{name}: {why}" for name, why in sorted(failing.items())))
        return web.json_response(body, status=503)
    return web.json_response(body, status=response.status)


def require_token(request: web.Request) -> None:
    """The bearer check of every mutating route (constant-time compare)."""
    expected = request.app[ADMIN_CONFIG].token
    if not expected:
        raise Forbidden(
            "mutations_disabled",
            f"this service has no admin token, so changes are refused: set {settings.ADMIN_TOKEN_ENV} "
            "for the service and send it as 'Authorization: Bearer <token>'",
        )
    if not tokens_equal(bearer_token(request), expected):
        raise Forbidden("forbidden", "the bearer token is wrong")


_READ_PREFIXES = ("/admin/", "/openapi.json")


@web.middleware
async def _read_gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With a read token configured, every read route needs it (or the admin token):
    401 without a bearer token, 403 with a wrong one. Mutations check their own."""
    expected = request.app[ADMIN_CONFIG].read_token
    if expected and request.method in ("GET", "HEAD") \
            and request.path.startswith(_READ_PREFIXES) and not may_read_private(request):
        bearer_token(request)  # no token at all: 401
        raise Forbidden("forbidden", f"the bearer token is neither {settings.READ_TOKEN_ENV} "
                                     f"nor {settings.ADMIN_TOKEN_ENV}")
    return await handler(request)


def may_read_private(request: web.Request) -> bool:
    """Whether the request presents the read token or the admin token: it may see a
    manifest's private fields (``extra``, the tensor index, random states)."""
    config = request.app[ADMIN_CONFIG]
    try:
        given = bearer_token(request)
    except Unauthorized:
        return False
    return any(bool(t) and tokens_equal(given, t or "") for t in (config.token, config.read_token))


def is_admin(request: web.Request) -> bool:
    """Whether the request presents the admin token (reads then show sources and URLs)."""
    expected = request.app[ADMIN_CONFIG].token
    try:
        return bool(expected) and tokens_equal(bearer_token(request), expected or "")
    except Unauthorized:
        return False


def _spec_view(spec: Any, admin: bool) -> Any:
    """A dataset's spec as a reader may see it: the source and the options (a
    tokenizer URL may carry ``?token=``) to the admin only, redacted even then."""
    if isinstance(spec, dict) and "source" in spec:
        spec = {**spec, "source": redact_url(spec["source"]) if admin else None}
    if isinstance(spec, dict) and "options" in spec:
        spec = {**spec, "options": redact_values(spec["options"]) if admin else None}
    return spec


BODY_TIMEOUT_S = 10.0


async def read_json_object(request: web.Request) -> dict[str, Any]:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except TimeoutError as exc:
        raise BadRequest("timeout", f"the body did not arrive within {BODY_TIMEOUT_S} s") from exc
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BadRequest("bad_json", f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("bad_json", f"the body must be a JSON object, got {type(body).__name__}")
    return body


def _step(request: web.Request) -> int:
    text = request.match_info["step"]
    if not text.isascii() or not text.isdigit() or len(text) > 18:
        raise BadRequest("bad_step", f"step {text!r} is not valid: expected an integer >= 0")
    return int(text)


# --------------------------------------------------------------------------- datasets


async def _list_datasets(request: web.Request) -> web.Response:
    admin = is_admin(request)
    rows = await inspection.list_datasets(request.app[_REDIS])
    return web.json_response({"datasets": [
        {**row, "spec": _spec_view(row["spec"], admin)} if "spec" in row else row for row in rows
    ]})


async def _show_dataset(request: web.Request) -> web.Response:
    r = request.app[_REDIS]
    info = await inspection.show_dataset(r, request.match_info["dataset"])
    return web.json_response({**info, "spec": _spec_view(info.get("spec"), is_admin(request))})


async def _groups(request: web.Request) -> web.Response:
    r = request.app[_REDIS]
    dataset = request.match_info["dataset"]
    return web.json_response(
        {"dataset": dataset, "groups": await inspection.dataset_groups(r, dataset)}
    )


async def _seek(request: web.Request) -> web.Response:
    require_token(request)
    body = await read_json_object(request)
    r = request.app[_REDIS_MUTATIONS]
    dataset, group = request.match_info["dataset"], request.match_info["group"]
    force = body.pop("force", False)
    if not isinstance(force, bool):
        raise BadRequest("bad_force", f"'force' must be true or false, got {force!r}")
    unknown = set(body) - {"to", "ids", "checkpoint"}
    if unknown or len(body) != 1:
        raise BadRequest(
            "bad_target",
            "the body must have exactly one of 'to' (\"earliest\"|\"latest\"), 'ids' "
            "({partition: ID}) or 'checkpoint' ({\"store\": name, \"step\": n}), and "
            f"optionally 'force'; got keys {sorted(body)}",
        )
    if "to" in body:
        to = seek.check_seek_target(body["to"])
        result = await seek.seek_group(r, dataset, group, to=to, force=force)
    else:
        spec_partitions = (await inspection.dataset_spec(r, dataset)).partitions
        raw = (
            body["ids"] if "ids" in body
            else await request.app[_STORES].checkpoint_offsets(body["checkpoint"], dataset)
        )
        ids = seek.parse_seek_ids(raw, spec_partitions)
        result = await seek.seek_group(r, dataset, group, ids=ids, force=force)
    return web.json_response(result)


# --------------------------------------------------------------------------- checkpoints


async def _list_stores(request: web.Request) -> web.Response:
    return web.json_response({"stores": request.app[_STORES].describe(full=is_admin(request))})


CHECKPOINTS_PAGE = 500
"""Checkpoints per page of ``/admin/checkpoints/{store}`` (oldest first)."""


async def _list_checkpoints(request: web.Request) -> web.Response:
    name = request.match_info["store"]
    offset, limit = page(request, default_limit=CHECKPOINTS_PAGE)
    rows = await until_gone(request, request.app[_STORES].list(name))
    return web.json_response({"store": name, "checkpoints": rows[offset:offset + limit],
                              "total": len(rows), "offset": offset, "limit": limit})


async def _show_checkpoint(request: web.Request) -> web.Response:
    name = request.match_info["store"]
    return web.json_response(await request.app[_STORES].show(
        name, _step(request), full=may_read_private(request)))


async def _verify_checkpoint(request: web.Request) -> web.Response:
    name = request.match_info["store"]
    return web.json_response(await request.app[_STORES].verify(name, _step(request)))


async def _pin(request: web.Request) -> web.Response:
    require_token(request)
    name = request.match_info["store"]
    return web.json_response(await request.app[_STORES].pin(name, _step(request), True))


async def _unpin(request: web.Request) -> web.Response:
    require_token(request)
    name = request.match_info["store"]
    return web.json_response(await request.app[_STORES].pin(name, _step(request), False))


async def _delete_checkpoint(request: web.Request) -> web.Response:
    require_token(request)
    name = request.match_info["store"]
    return web.json_response(await request.app[_STORES].delete(name, _step(request)))


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/admin/datasets", _list_datasets),
    ("GET", "/admin/datasets/{dataset}", _show_dataset),
    ("GET", "/admin/datasets/{dataset}/groups", _groups),
    ("POST", "/admin/datasets/{dataset}/groups/{group}/seek", _seek),
    ("GET", "/admin/checkpoints", _list_stores),
    ("GET", "/admin/checkpoints/{store}", _list_checkpoints),
    ("GET", "/admin/checkpoints/{store}/{step}", _show_checkpoint),
    ("DELETE", "/admin/checkpoints/{store}/{step}", _delete_checkpoint),
    ("GET", "/admin/checkpoints/{store}/{step}/verify", _verify_checkpoint),
    ("POST", "/admin/checkpoints/{store}/{step}/pin", _pin),
    ("POST", "/admin/checkpoints/{store}/{step}/unpin", _unpin),
    ("GET", "/openapi.json", _openapi),
)
"""Every admin route; ``openapi.py`` documents exactly these (a test compares)."""


async def stores_ready(app: web.Application) -> dict[str, str]:
    """``{store: "ok" | reason}`` for a readiness probe: each root can be listed."""
    return await app[_STORES].ready()


def setup_admin(app: web.Application, config: AdminConfig | None = None, *,
                verify_threads: int = 2) -> AdminConfig:
    """Add the admin routes, the JSON error middleware and the Redis client/store
    lifecycle to ``app``. The config comes from ``config``, else ``app[ADMIN_CONFIG]``
    when the caller set it, else the environment (:meth:`AdminConfig.from_env`)."""
    if config is None:
        config = app[ADMIN_CONFIG] if ADMIN_CONFIG in app else AdminConfig.from_env()
    app[ADMIN_CONFIG] = config
    app[_STORES] = StoreSet(config.stores, verify_threads=verify_threads)
    if json_errors not in app.middlewares:
        app.middlewares.append(json_errors)
    app.middlewares.append(_read_gate)
    app.middlewares.append(_ready_with_stores)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)

    async def _lifecycle(app: web.Application):  # type: ignore[no-untyped-def]
        # Reads and mutations each have a pool of their own that queues (a burst of
        # anonymous reads waits its turn, and never takes the connections a seek needs).
        reads = redis_client.client(config.redis_url, socket_timeout=10,
                                    max_connections=READ_CONNECTIONS,
                                    queue_timeout_s=POOL_QUEUE_TIMEOUT_S)
        writes = redis_client.client(config.redis_url, socket_timeout=10,
                                     max_connections=MUTATION_CONNECTIONS,
                                     queue_timeout_s=POOL_QUEUE_TIMEOUT_S)
        app[_REDIS], app[_REDIS_MUTATIONS] = reads, writes
        try:
            yield
        finally:
            await reads.aclose()
            await writes.aclose()
            await asyncio.to_thread(app[_STORES].close)

    app.cleanup_ctx.append(_lifecycle)
    return config
