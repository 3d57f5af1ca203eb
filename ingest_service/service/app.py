"""The aiohttp service: health, readiness, metrics, push ingestion, background producers.

Routes::

    GET  /healthz                          200 while the process serves
    GET  /readyz                           200 when Redis answers, else 503 (JSON reasons);
                                           with ``durability`` and ``lost_acknowledged_data``
    GET  /metrics                          Prometheus text (this app's own registry)
    POST /v1/datasets/{name}/records       push a batch: ?producer_id=..&seq=..
    GET  /v1/push/durability               whether Redis keeps acknowledged pushes, and
                                           what it lost (:mod:`ingest_service.push.durability`)

The push route and its answers are :mod:`ingest_service.service.push_route`'s; who may push
is :mod:`ingest_service.service.auth`'s. Every error of every route is JSON of one shape
(:mod:`ingest_service.service.http_errors`), and requests whose ``Host`` is not a configured
name get 421 (probes excepted).

Shutdown (SIGTERM under ``trainguard serve``): the listening socket closes first, requests in
flight finish (their appends are what was acknowledged), then the producers finish the
batches they handed to Redis and stop, then the Redis client closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import redis.exceptions as redis_errors
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ingest_service import redis_client
from ingest_service.metrics import IngestMetrics
from ingest_service.push import pool as push_pool
from ingest_service.push.durability import DURABILITY_KEY, DurabilityWatch, setup_durability
from ingest_service.push.ingest import PushIngest
from ingest_service.service.admin import AdminConfig, setup_admin
from ingest_service.service.auth import host_check_middleware
from ingest_service.service.config import CONFIG_KEY, METRICS_KEY, REDIS_KEY, IngestConfig
from ingest_service.service.http_errors import json_errors
from ingest_service.service.nodes import setup_nodes
from ingest_service.service.push_route import setup_push
from ingest_service.service.runs import setup_runs
from ingest_service.service.supervisor import Supervisor
from ingest_service.service.ui import setup_ui
from trainguard.core.urls import redact_text

__all__ = ["PUSH_KEY", "READ_BUFSIZE", "SUPERVISOR_KEY", "create_app"]

log = logging.getLogger(__name__)

SUPERVISOR_KEY = web.AppKey("trainguard_ingest_supervisor", Supervisor)
PUSH_KEY = web.AppKey("trainguard_ingest_push", PushIngest)
_STOPPING = web.AppKey("trainguard_ingest_stopping", asyncio.Event)
READ_BUFSIZE = 64 * 1024
"""Bytes of a request body aiohttp buffers per connection before the handler reads them
(it pauses the socket past twice this)."""


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    app = request.app
    if app[_STOPPING].is_set():
        return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
    try:
        await asyncio.wait_for(app[REDIS_KEY].ping(), 2.0)
    except (redis_errors.RedisError, OSError, TimeoutError) as exc:
        # Anonymous: the error's type only (its text names hosts); the rest to the log.
        log.warning("not ready: redis: %s", redact_text(f"{type(exc).__name__}: {exc}"))
        return web.json_response({"ready": False, "reason": f"redis: {type(exc).__name__}",
                                  **app[DURABILITY_KEY].report()}, status=503)
    # Ready even when Redis lost acknowledged pushes: the service serves on, and says so.
    return web.json_response({"ready": True, **app[DURABILITY_KEY].report()})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: IngestConfig) -> web.Application:
    """The service as an aiohttp application (not started)."""
    # client_max_size bounds what request.read() buffers (the admin API's JSON bodies);
    # push bodies stream through their own limits.
    #
    # read_bufsize: how much of a request body aiohttp buffers before the handler reads
    # it (it stops reading the socket at twice this). aiohttp's 256 KiB let each of 300
    # connections waiting for their turn (or for a 503) hold 0.5-0.7 MB outside the push
    # body budget (+200 MB); a push body is read as it comes, so 64 KiB costs no speed.
    app = web.Application(client_max_size=1024 * 1024,
                          middlewares=[json_errors, host_check_middleware(config.allowed_hosts)],
                          handler_args={"read_bufsize": READ_BUFSIZE})
    # Each producer holds its writer links (16 by default) for a whole epoch, so the
    # pool must allow more than redis-py's default of 100 connections.
    client = redis_client.client(config.redis_url, socket_timeout=30, socket_connect_timeout=5,
                                 max_connections=4096)
    metrics_ = IngestMetrics()
    app[CONFIG_KEY] = config
    app[REDIS_KEY] = client
    app[METRICS_KEY] = metrics_
    # Pushes on their own bounded, trimmed pool (ingest_service.push.pool).
    push_client = push_pool.push_client(
        config.redis_url, max_connections=config.push_pool_connections,
        timeout_s=config.push_pool_wait_s, idle_s=config.push_pool_idle_s,
        socket_timeout=30, socket_connect_timeout=5)
    app[PUSH_KEY] = PushIngest(
        push_client, config.limits, retry_after_s=config.push_retry_after_s,
        wait_replicas=config.push_wait_replicas, wait_ms=config.push_wait_ms,
    )
    app[SUPERVISOR_KEY] = Supervisor(client, config, metrics_)
    app[_STOPPING] = asyncio.Event()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    setup_push(app, app[PUSH_KEY], app[_STOPPING])
    setup_durability(app, DurabilityWatch(client, app[PUSH_KEY],
                                          interval_s=config.durability_interval_s,
                                          wait_aof=config.push_wait_aof))
    app.on_shutdown.append(_on_shutdown)
    app.cleanup_ctx.append(_background)

    # The admin API adds its routes here, on the same Redis URL.
    setup_admin(app, AdminConfig.from_env(config.redis_url), verify_threads=config.verify_threads)
    # The operator's view: run history, dataset detail (read-only JSON) and /ui.
    setup_runs(app)
    setup_nodes(app)
    setup_ui(app)
    return app


async def _on_shutdown(app: web.Application) -> None:
    app[_STOPPING].set()


async def _background(app: web.Application) -> AsyncIterator[None]:
    supervisor = app[SUPERVISOR_KEY]
    task: asyncio.Task[None] | None = None
    if app[CONFIG_KEY].produce:
        task = asyncio.create_task(supervisor.run(), name="trainguard-ingest-supervisor")
    watch = asyncio.create_task(app[DURABILITY_KEY].run(app[_STOPPING]),
                                name="trainguard-ingest-durability")
    push_client = app[PUSH_KEY].redis
    trim = asyncio.create_task(push_pool.run_trim(push_client, app[_STOPPING]),
                               name="trainguard-ingest-push-pool")
    try:
        yield
    finally:
        app[_STOPPING].set()
        supervisor.stop()
        if task is not None:
            await task
        await watch
        await trim
        if push_client is not app[REDIS_KEY]:
            await push_client.aclose()
        await app[REDIS_KEY].aclose()
