"""A push body read within limits while it streams: :func:`read_body`, :class:`ByteBudget`.

Reading (on the event loop) counts bytes as they arrive and, for NDJSON and msgpack,
records too (newlines; a msgpack array's header), so an oversized request is refused
(413) as soon as it passes a limit, not after it was buffered. One timer bounds the
wait for the next chunk: each chunk within ``chunk_timeout_s``, the whole body within
``total_timeout_s``, and, after ``min_rate_grace_s``, the body at least at
``min_rate_bytes_s`` on average (408): a body trickled a byte at a time does not hold
a slot, nor its room in the budget.

The bytes of every body in memory are taken from one :class:`ByteBudget` (503 busy
past ``max_inflight_bytes``), from its first chunk until its records are appended
(the parsed entries replace the body, about as large), and each producer token may
hold at most its share of it (``token_inflight_bytes``): one token trickling bodies
cannot keep another dataset's producers out.

A body that a decode worker will parse (over ``inline_bytes``) is written chunk by
chunk into a :class:`~ingest_service.push.spool.SpooledBody` that the worker receives,
never gathered into one buffer on the loop.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from aiohttp import StreamReader

from ingest_service.errors import PushBusyError, PushTooLargeError, PushTooSlowError
from ingest_service.push.body import (
    MSGPACK_TYPES,
    NDJSON_TYPE,
    BodyLimits,
    msgpack_array_len,
    too_many,
)
from ingest_service.push.spool import SpooledBody

__all__ = ["ByteBudget", "read_body"]


class ByteBudget:
    """Bytes of push bodies held in memory by all requests together (``limit``) and per
    owner (a producer token: ``owner_limit``), shown by ``gauge`` (anything with
    ``set(value)``) when given."""

    def __init__(self, limit: int, gauge: Any = None, *, owner_limit: int | None = None) -> None:
        self.limit, self.used, self._gauge = limit, 0, gauge
        self.owner_limit = limit if owner_limit is None else owner_limit
        self._owners: Counter[str] = Counter()

    def take(self, n: int, owner: str = "") -> None:
        if self.used + n > self.limit:
            raise PushBusyError(
                f"the service holds {self.used} bytes of push bodies, its bound is {self.limit}: "
                "retry after Retry-After seconds"
            )
        if self._owners[owner] + n > self.owner_limit:
            raise PushBusyError(
                f"this producer token's requests hold {self._owners[owner]} bytes of push "
                f"bodies, the bound per token is {self.owner_limit}: finish the bodies under "
                "way, or retry after Retry-After seconds"
            )
        self.used += n
        self._owners[owner] += n
        if self._gauge is not None:
            self._gauge.set(self.used)

    def give(self, n: int, owner: str = "") -> None:
        self.used -= n
        self._owners[owner] -= n
        if self._owners[owner] <= 0:
            del self._owners[owner]  # the counter holds only owners with bytes held
        if self._gauge is not None:
            self._gauge.set(self.used)


async def read_body(content: StreamReader, content_type: str, limits: BodyLimits,
                    budget: ByteBudget, owner: str = "", *, length: int | None = None,
                    spool_over: int | None = None) -> bytearray | SpooledBody:
    """The whole body, refused with 413 as soon as it passes a limit, with 408 when it
    arrives too slowly, or with 503 when the bodies of all requests together (or of
    ``owner``'s) would pass ``budget``. The bytes stay taken from ``budget``: the
    caller gives back ``len(body)`` for ``owner`` when done with it.

    Each chunk is copied into one buffer as it arrives and dropped: a list of chunks
    joined at the end held every body twice at its peak, which the budget did not
    count. With ``length`` (the declared Content-Length) its room is taken from the
    budget before a byte is read (503 at once when there is none) and the buffer is
    made that size once, so the memory a body holds is always what it took.

    With ``spool_over`` (a decode pool parses bodies over that size), a body declared
    or found to be longer goes into a :class:`SpooledBody` instead, chunk by chunk (what
    it holds so far moved there once it passes ``spool_over``: at most that much and a
    chunk): no step of the loop allocates, zeroes or copies the whole body."""
    taken = 0  # the bytes taken from the budget so far
    spool: SpooledBody | None = None
    if length is not None and 0 < length <= limits.max_bytes:
        budget.take(length, owner)
        taken = length
    if spool_over is not None and length is not None and length > spool_over:
        spool, body = SpooledBody(), bytearray()
    elif taken:
        body = bytearray(taken)
    else:
        body = bytearray()
    size = newlines = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + limits.total_timeout_s
    slow_from = started + limits.min_rate_grace_s
    rate = limits.min_rate_bytes_s
    head = b""
    try:
        # One timer for the whole body, moved at each chunk (wait_for per chunk made a
        # task and a timer per chunk: a tenth of a small push's cost).
        async with asyncio.timeout(None) as window:
            while True:
                due = min(loop.time() + limits.chunk_timeout_s, deadline)
                if rate:  # by then the bytes in are below the minimum rate
                    due = min(due, slow_from + size / rate)
                window.reschedule(due)
                chunk = await content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > limits.max_bytes:
                    raise PushTooLargeError(
                        f"the body is over {limits.max_bytes} bytes: the limit per request; "
                        "send smaller batches"
                    )
                if content_type == NDJSON_TYPE:
                    newlines += chunk.count(b"\n")
                    if newlines > limits.max_records:
                        raise too_many(limits, f"more than {limits.max_records}")
                elif content_type in MSGPACK_TYPES and len(head) < 5:
                    head += chunk[:5]
                    count = msgpack_array_len(head)
                    if count is not None and count > limits.max_records:
                        raise too_many(limits, str(count))
                if size > taken:  # past the room taken (no length declared, or a longer body)
                    budget.take(size - taken, owner)
                    taken = size
                if spool is None and spool_over is not None and size > spool_over:
                    spool = SpooledBody.of(body[:size - len(chunk)])  # at most spool_over
                    body = bytearray()
                if spool is not None:
                    spool.write(chunk)
                else:
                    body[size - len(chunk):size] = chunk
                del chunk
    except TimeoutError as exc:
        budget.give(taken, owner)
        if spool is not None:
            spool.close()
        raise PushTooSlowError(
            f"the body did not arrive in time ({size} bytes in {loop.time() - started:.1f} s: "
            f"each chunk within {limits.chunk_timeout_s} s, after {limits.min_rate_grace_s} s "
            f"at least {rate} bytes/s, the whole body within {limits.total_timeout_s} s); "
            "send it at once"
        ) from exc
    except BaseException:
        budget.give(taken, owner)
        if spool is not None:
            spool.close()
        raise
    if spool is not None:
        if size < taken:
            budget.give(taken - size, owner)
        return spool
    if size < len(body):  # shorter than declared (aiohttp refuses that): keep what came
        del body[size:]
        budget.give(taken - size, owner)
    return body
