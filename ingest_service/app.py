"""The aiohttp service: health, readiness, metrics, push ingestion, background producers.

Routes::

    GET  /healthz                          200 while the process serves
    GET  /readyz                           200 when Redis answers, else 503 (JSON reasons)
    GET  /metrics                          Prometheus text (this app's own registry)
    POST /v1/datasets/{name}/records       push a batch: ?producer_id=..&seq=..[&partition=..]

Push answers are JSON: 200 ``{"appended": true|false, "partition", "seq", "ids", "mark"}``
(``appended: false`` is a retry of a batch already appended); 400 malformed and 413 too
large with ``{"error": {"code", "message"}}``; 404 unknown dataset; 409 not a push dataset; 429 with
``Retry-After`` when the partition's backlog is full; 503 while shutting down.

Shutdown (SIGTERM under ``trainguard serve``): the listening socket closes first, requests in
flight finish (their appends are what was acknowledged), then the producers finish the
batches they handed to Redis and stop, then the Redis client closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import redis.exceptions as redis_errors
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ingest_service import redis_client
from ingest_service.admin import AdminConfig, setup_admin
from ingest_service.config import CONFIG_KEY, METRICS_KEY, REDIS_KEY, IngestConfig
from ingest_service.datasets import describe_dataset
from ingest_service.errors import (
    BacklogFullError,
    DatasetNotFoundError,
    NotReplicatedError,
    PushRejectedError,
    PushTooLargeError,
    WrongDatasetKindError,
)
from ingest_service.metrics import IngestMetrics
from ingest_service.push import PushIngest, parse_params, parse_records
from ingest_service.runs import setup_runs
from ingest_service.supervisor import Supervisor
from ingest_service.ui import setup_ui
from trainguard.core import streams

__all__ = ["PUSH_KEY", "SUPERVISOR_KEY", "create_app"]

log = logging.getLogger(__name__)

SUPERVISOR_KEY = web.AppKey("trainguard_ingest_supervisor", Supervisor)
PUSH_KEY = web.AppKey("trainguard_ingest_push", PushIngest)
_STOPPING = web.AppKey("trainguard_ingest_stopping", asyncio.Event)


_ERROR_CODES = {400: "bad_request", 404: "not_found", 409: "conflict", 413: "too_large",
                429: "backlog_full", 503: "unavailable"}


_NOT_ACKNOWLEDGED: tuple[type[Exception], ...] = (NotReplicatedError, *redis_client.TRANSIENT)


def _error(status: int, reason: str, **headers: str) -> web.Response:
    # The same shape as every admin error: {"error": {"code", "message"}}.
    body = {"error": {"code": _ERROR_CODES.get(status, "error"), "message": reason}}
    return web.json_response(body, status=status, headers=headers or None)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    app = request.app
    if app[_STOPPING].is_set():
        return web.json_response({"ready": False, "reason": "shutting down"}, status=503)
    try:
        await asyncio.wait_for(app[REDIS_KEY].ping(), 2.0)
    except (redis_errors.RedisError, OSError, TimeoutError) as exc:
        return web.json_response({"ready": False, "reason": f"redis: {exc}"}, status=503)
    return web.json_response({"ready": True})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def push_records(request: web.Request) -> web.Response:
    app = request.app
    name = request.match_info["name"]
    status_counter = app[METRICS_KEY].push_requests
    response = await _push(request, name)
    with contextlib.suppress(streams.ContractError):
        streams.check_name("dataset", name)
        status_counter.labels(dataset=name, status=str(response.status)).inc()
    return response


async def _push(request: web.Request, name: str) -> web.Response:
    app = request.app
    config = app[CONFIG_KEY]
    if app[_STOPPING].is_set():
        return _error(503, "the service is shutting down: send to another instance or retry")
    try:
        spec = await describe_dataset(app[REDIS_KEY], name)
    except streams.ContractError as exc:
        return _error(400, str(exc))
    except DatasetNotFoundError as exc:
        return _error(404, str(exc))
    if request.content_length is not None and request.content_length > config.max_push_body_bytes:
        return _error(413, f"body of {request.content_length} bytes: the limit is "
                           f"{config.max_push_body_bytes}; send smaller batches")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _error(413, f"body over {config.max_push_body_bytes} bytes; send smaller batches")
    try:
        producer_id, seq, partition = parse_params(request.query, spec.partitions)
        records = parse_records(body, request.content_type, spec.max_record_bytes)
        result = await app[PUSH_KEY].append(spec, producer_id, seq, records, partition)
    except (PushRejectedError, PushTooLargeError) as exc:
        return _error(exc.status, str(exc))
    except WrongDatasetKindError as exc:
        return _error(409, str(exc))
    except BacklogFullError as exc:
        return _error(429, str(exc), **{"Retry-After": str(exc.retry_after_s)})
    except _NOT_ACKNOWLEDGED as exc:
        # Redis is failing over (or was not replicated in time): nothing acknowledged;
        # the producer retries with the same seq, which is never appended twice.
        return _error(503, f"not acknowledged: {exc}; retry with the same seq",
                      **{"Retry-After": str(config.push_retry_after_s)})
    if result.appended:
        app[METRICS_KEY].records.labels(dataset=name).inc(len(records))
        app[METRICS_KEY].bytes.labels(dataset=name).inc(sum(streams.record_size(f) for f in records))
    return web.json_response({
        "appended": result.appended, "partition": result.partition, "seq": result.seq,
        "ids": result.ids, "mark": result.mark,
    })


def create_app(config: IngestConfig) -> web.Application:
    """The service as an aiohttp application (not started)."""
    app = web.Application(client_max_size=config.max_push_body_bytes)
    # Each producer holds its writer links (16 by default) for a whole epoch, so the
    # pool must allow more than redis-py's default of 100 connections.
    client = redis_client.client(config.redis_url, socket_timeout=30, max_connections=4096)
    metrics_ = IngestMetrics()
    app[CONFIG_KEY] = config
    app[REDIS_KEY] = client
    app[METRICS_KEY] = metrics_
    app[PUSH_KEY] = PushIngest(
        client, config.limits, retry_after_s=config.push_retry_after_s,
        wait_replicas=config.push_wait_replicas, wait_ms=config.push_wait_ms,
    )
    app[SUPERVISOR_KEY] = Supervisor(client, config, metrics_)
    app[_STOPPING] = asyncio.Event()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/datasets/{name}/records", push_records)
    app.on_shutdown.append(_on_shutdown)
    app.cleanup_ctx.append(_background)

    # The admin API adds its routes here, on the same Redis URL.
    setup_admin(app, AdminConfig.from_env(config.redis_url))
    # The operator's view: run history, dataset detail (read-only JSON) and /ui.
    setup_runs(app)
    setup_ui(app)
    return app


async def _on_shutdown(app: web.Application) -> None:
    app[_STOPPING].set()


async def _background(app: web.Application) -> AsyncIterator[None]:
    supervisor = app[SUPERVISOR_KEY]
    task: asyncio.Task[None] | None = None
    if app[CONFIG_KEY].produce:
        task = asyncio.create_task(supervisor.run(), name="trainguard-ingest-supervisor")
    try:
        yield
    finally:
        app[_STOPPING].set()
        supervisor.stop()
        if task is not None:
            await task
        await app[REDIS_KEY].aclose()
