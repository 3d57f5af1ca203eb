"""``POST /v1/datasets/{name}/records``: the push route, in the order its checks run.

1. The service is not shutting down (else 503).
2. Who: the bearer token is a producer token (401), the dataset name and query are
   well-formed (400), and the token covers this dataset and producer_id (403). With
   no producer token configured, push is refused (403), unless the service runs
   ``--insecure-local`` (loopback only, for the demo).
3. What: the content type is NDJSON, JSON or msgpack (415); a declared length over
   the limit is 413 before a byte is read.
4. Where: the dataset exists (404) and takes pushes (409); ``seq`` is the producer's
   next (409 with the mark otherwise; a retry of a batch that is in is answered 200
   without reading its body); the producer's partition has room (429 with
   ``Retry-After``). All before the body is read.
5. The body streams in within its limits (413; 408 when a chunk is late or the body
   arrives under the minimum rate; 503 when the bodies in memory, or those of this
   producer token, are at their bound), is parsed by a decode worker process when it
   is over 128 KiB or holds over 500 values (JSON: brackets) (503 busy when the pool's
   queue is full or the worker died; 413 past the decode timeout), else in slices on
   the loop; a record past its container or nesting bound is 413 before it is decoded
   whole (400, 413); then the body is checked against the
   backlog again with its real size, and appended in slices (409 with the mark when
   ``seq`` is out of order; 409 ``batch_mismatch`` when another batch is partly in
   under ``seq``; 503 with ``Retry-After`` when Redis is out of reach or failing over,
   or when no replica, or where there is none the append-only file, took the batch in
   time: acknowledged only once it has, see ``PushIngest``).
6. Against what this service acknowledged before: a producer whose mark in Redis went
   back (Redis restarted older) is answered 409 ``lost_acknowledged_data`` once, with
   the seqs lost (:mod:`ingest_service.push.ledger`).

The answer is small whatever the batch: ``{"appended", "partition", "seq", "mark",
"count", "first_id", "last_id"}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from redis.exceptions import RedisError

from ingest_service.errors import (
    AdminError,
    BacklogFullError,
    BatchMismatchError,
    DatasetNotFoundError,
    Forbidden,
    MalformedPushError,
    NotReplicatedError,
    PushBusyError,
    PushDataLostError,
    PushOutOfOrderError,
    PushRejectedError,
    PushTooLargeError,
    UnsupportedMediaError,
    WrongDatasetKindError,
)
from ingest_service.push.body import CONTENT_TYPES, BodyLimits, ParsedBatch, parse_records_sliced
from ingest_service.push.decode_pool import DecodePool, needs_worker
from ingest_service.push.entries import Body
from ingest_service.push.ingest import (
    PushIngest,
    PushResult,
    choose_partition,
    parse_params,
)
from ingest_service.push.read import ByteBudget, read_body
from ingest_service.push.spool import SpooledBody
from ingest_service.service.auth import PushTokens, bearer_token
from ingest_service.service.config import CONFIG_KEY, METRICS_KEY
from ingest_service.service.http_errors import RETRY_AFTER_S, error_response, unavailable
from trainguard.core import push_wire, streams

__all__ = ["PUSH_KEY", "PushRoute", "setup_push"]

_CODES = {400: "bad_request", 408: "timeout", 409: "conflict", 413: "too_large",
          415: "unsupported_media_type", 429: "backlog_full", 503: "busy"}


@dataclass
class PushRoute:
    """What the route holds: the appender, the tokens, the bound on the bytes of
    bodies in memory at once, and the one slot of big-body parsing."""

    ingest: PushIngest
    tokens: PushTokens
    insecure_local: bool
    limits: BodyLimits
    budget: ByteBudget
    big_bodies: asyncio.Semaphore
    stopping: asyncio.Event
    decoders: DecodePool | None = None
    """The decode worker processes (None: ``decode_workers`` is 0, all parsed inline)."""

    def authorize(self, request: web.Request, dataset: str, producer_id: str) -> None:
        if self.insecure_local:
            return
        if not self.tokens.tokens:
            raise Forbidden(
                "push_disabled",
                "this service has no producer token, so pushes are refused: set "
                "TRAINGUARD_PUSH_TOKENS='<token>:<dataset>:<producer_id or prefix*>' for the "
                "service and send 'Authorization: Bearer <token>'",
            )
        self.tokens.authorize(request, dataset, producer_id)


PUSH_KEY = web.AppKey("trainguard_ingest_push_route", PushRoute)


async def push_records(request: web.Request) -> web.StreamResponse:
    app = request.app
    known: list[streams.DatasetSpec] = []
    try:
        response = await _push(request, app[PUSH_KEY], known)
    except PushOutOfOrderError as exc:
        response = error_response(409, push_wire.OUT_OF_ORDER, str(exc), details={"mark": exc.mark})
    except BatchMismatchError as exc:
        response = error_response(409, push_wire.BATCH_MISMATCH, str(exc), details={
            "appended": exc.appended, "count": exc.count, "digest": exc.digest})
    except PushDataLostError as exc:
        response = error_response(409, push_wire.LOST_ACKNOWLEDGED_DATA, str(exc), details={
            "mark": exc.mark, "acknowledged": exc.acknowledged})
    except BacklogFullError as exc:
        response = error_response(429, "backlog_full", str(exc),
                                  {"Retry-After": str(exc.retry_after_s)})
    except PushRejectedError as exc:
        retry = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        response = error_response(exc.status, _CODES.get(exc.status, "bad_request"), str(exc),
                                  retry)
    except AdminError as exc:
        response = error_response(exc.status, exc.code, str(exc))
    except DatasetNotFoundError as exc:
        response = error_response(404, "not_found", str(exc))
    except WrongDatasetKindError as exc:
        response = error_response(409, "not_a_push_dataset", str(exc))
    except NotReplicatedError as exc:
        # On the master, not yet on a replica: not acknowledged; the retry with the same
        # seq appends nothing twice and is answered once a replica has the batch.
        response = error_response(503, "not_replicated", str(exc),
                                  {"Retry-After": str(RETRY_AFTER_S)})
    except (RedisError, OSError) as exc:
        # Redis out of reach, or failing over (a cluster's MOVED/CLUSTERDOWN/TRYAGAIN):
        # nothing acknowledged, the producer resends the same seq.
        response = unavailable(exc)
    if response.status >= 400 and response.status != 429:
        response.force_close()  # the rest of a refused body is not worth reading
    # Labels only for datasets that exist: a scan of made-up names adds none.
    label = known[0].name if known else "-"
    app[METRICS_KEY].push_requests.labels(dataset=label, status=str(response.status)).inc()
    return response


async def _push(request: web.Request, route: PushRoute,
                known: list[streams.DatasetSpec]) -> web.Response:
    app = request.app
    if route.stopping.is_set():
        return error_response(503, "unavailable", "the service is shutting down: send to another "
                              "instance or retry", {"Retry-After": str(RETRY_AFTER_S)})
    name = request.match_info["name"]
    try:
        streams.check_name("dataset", name)
    except streams.ContractError as exc:
        raise MalformedPushError(str(exc)) from exc
    producer_id, seq = parse_params(request.query)
    route.authorize(request, name, producer_id)
    content_type = request.content_type
    if content_type not in CONTENT_TYPES:
        raise UnsupportedMediaError(
            f"Content-Type {content_type!r} is not accepted: send one of {list(CONTENT_TYPES)}"
        )
    length = request.content_length
    if length is not None and length > route.limits.max_bytes:
        raise PushTooLargeError(f"the body is {length} bytes: the limit is "
                                f"{route.limits.max_bytes} per request; send smaller batches")
    spec, mark = await route.ingest.admit(name, producer_id, seq, known)
    if mark is not None:  # a retry of a batch that is in: its body is not even read
        return _reply(PushResult(choose_partition(producer_id, spec.partitions), seq, False, 0,
                                 None, None, mark))
    owner = _owner(request, route)
    # With a decode pool, a body it will parse (over inline_bytes) is spooled to a file
    # the worker reads, never one buffer of this process: no loop step is O(body).
    spool_over = None if route.decoders is None else route.limits.inline_bytes
    body = await read_body(request.content, content_type, route.limits, route.budget, owner,
                           length=length, spool_over=spool_over)
    held = len(body)
    try:
        # The body's room in the budget is held until its records are appended: the
        # parsed entries that replace it are about as large.
        batch = await _parse(route, body, content_type, spec.max_record_bytes)
        body = bytearray()  # its memory free while its entries are appended
        await route.ingest.check_room(spec, producer_id, seq, len(batch.records),
                                      batch.data_bytes)
        result = await route.ingest.append(spec, producer_id, seq, batch.records, batch.sizes,
                                           batch.digest)
    finally:
        route.budget.give(held, owner)
        if isinstance(body, SpooledBody):
            body.close()  # refused before a worker took it (503 busy, or shutting down)
    if result.count:
        metrics = app[METRICS_KEY]
        metrics.records.labels(dataset=name).inc(result.count)
        # The entries this request appended: a retry's completion counts its share.
        metrics.bytes.labels(dataset=name).inc(sum(batch.sizes[len(batch.sizes) - result.count:]))
    return _reply(result)


async def _parse(route: PushRoute, body: Body | SpooledBody, content_type: str,
                 max_record_bytes: int) -> ParsedBatch:
    """A big or container-heavy body parsed by a decode worker, the others on the loop
    in slices (bodies over ``big_body_bytes`` one at a time there, at a share of it)."""
    limits = route.limits
    if route.decoders is not None and (isinstance(body, SpooledBody)
                                       or needs_worker(body, content_type, limits)):
        return await route.decoders.parse(body, content_type, max_record_bytes)
    if isinstance(body, SpooledBody):
        # The pool went away between reading and parsing (the service stopping).
        raise PushBusyError("the service is shutting down: send to another instance or retry")
    if len(body) > limits.big_body_bytes:
        async with route.big_bodies:
            return await parse_records_sliced(body, content_type, max_record_bytes, limits,
                                              share=limits.big_body_share)
    return await parse_records_sliced(body, content_type, max_record_bytes, limits)


def _owner(request: web.Request, route: PushRoute) -> str:
    """Whose share of the body budget a request takes: its producer token (the peer's
    address when the service runs without tokens)."""
    if route.insecure_local:
        return str(request.remote)
    return bearer_token(request)


def _reply(result: PushResult) -> web.Response:
    return web.json_response({
        "appended": result.appended, "partition": result.partition, "seq": result.seq,
        "mark": result.mark, "count": result.count, "first_id": result.first_id,
        "last_id": result.last_id,
    })


def setup_push(app: web.Application, ingest: PushIngest, stopping: asyncio.Event) -> PushRoute:
    """Add the push route to ``app`` with what ``app[CONFIG_KEY]`` configures."""
    config = app[CONFIG_KEY]
    route = PushRoute(
        ingest=ingest, tokens=config.push_tokens, insecure_local=config.insecure_local,
        limits=config.push_limits,
        budget=ByteBudget(config.push_limits.max_inflight_bytes,
                          app[METRICS_KEY].push_body_bytes,
                          owner_limit=config.push_limits.token_inflight_bytes),
        big_bodies=asyncio.Semaphore(1),
        stopping=stopping,
    )
    app[PUSH_KEY] = route
    app.router.add_post(push_wire.RECORDS_ROUTE, push_records)
    if config.push_limits.decode_workers:
        app.cleanup_ctx.append(_decoders)
    return route


async def _decoders(app: web.Application) -> AsyncIterator[None]:
    """The decode pool lives with the running app: its workers start as bodies need
    them, and stop with it."""
    route = app[PUSH_KEY]
    route.decoders = DecodePool(route.limits, retry_after_s=RETRY_AFTER_S)
    try:
        yield
    finally:
        pool, route.decoders = route.decoders, None
        await pool.close()
