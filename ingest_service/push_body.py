"""A push body: read within limits while it streams, then parsed into stream entries.

Reading (:func:`read_body`, on the event loop) counts bytes as they arrive and, for
NDJSON and msgpack, records too (newlines; a msgpack array's header), so an oversized
request is refused (413) as soon as it passes a limit, not after it was buffered.
Each chunk must arrive within ``chunk_timeout_s`` and the whole body within
``total_timeout_s`` (408): a body trickled a byte at a time does not hold a slot.

Parsing (:func:`parse_records_sliced`) runs on the event loop in slices: it decodes
record by record (one JSON line, one element of a JSON array, one msgpack item per
call) and hands the loop back after every 64 records or 128 KiB, so other requests are
served between slices. Bodies over ``big_body_bytes`` (1 MiB; an RL batch is a
fraction of that) parse one at a time and rest between slices, together taking at most
a quarter of the loop: a client sending the worst case in a loop slows itself, not the
others. (Not worker threads: a thread parsing a big body holds the GIL
for 5 ms turns, and every wake-up of the loop then waits a turn; under load that
added up to seconds.)

Content types: ``application/x-ndjson`` (one JSON value per line), ``application/json``
(one array of records), ``application/msgpack`` (one array; ``bin`` items stay raw
bytes). Anything else is 415. Malformed numbers (integers over 64 bits or thousands
of digits), nesting deeper than the decoders allow, and undecodable text are 400.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import msgpack
from aiohttp import StreamReader

from ingest_service.errors import (
    MalformedPushError,
    PushBusyError,
    PushTooLargeError,
    PushTooSlowError,
)
from trainguard.core import streams

__all__ = [
    "CONTENT_TYPES",
    "JSON_TYPE",
    "MSGPACK_TYPES",
    "NDJSON_TYPE",
    "BodyLimits",
    "ByteBudget",
    "parse_records_sliced",
    "read_body",
]

NDJSON_TYPE = "application/x-ndjson"
JSON_TYPE = "application/json"
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
CONTENT_TYPES = (NDJSON_TYPE, JSON_TYPE, *MSGPACK_TYPES)


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = 16 * 1024 * 1024
    max_records: int = 10_000
    chunk_timeout_s: float = 10.0
    total_timeout_s: float = 60.0
    big_body_bytes: int = 1024 * 1024
    """Bodies above this parse one at a time, at ``big_body_share`` of the loop."""
    big_body_share: float = 0.25
    max_inflight_bytes: int = 64 * 1024 * 1024
    """All push bodies in memory at once; past it a request is answered 503 (busy)."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_records < 1:
            raise ValueError(f"push limits must be >= 1, got {self}")
        if self.max_inflight_bytes < self.max_bytes:
            raise ValueError(
                f"max_inflight_bytes ({self.max_inflight_bytes}) must hold at least one body of "
                f"max_bytes ({self.max_bytes})"
            )


def _too_many(limits: BodyLimits, found: str) -> PushTooLargeError:
    return PushTooLargeError(
        f"the batch holds {found} records: the limit is {limits.max_records} per request; "
        "send smaller batches"
    )


def _msgpack_array_len(head: bytes) -> int | None:
    """The element count of a msgpack array from its first bytes (None: not yet known
    or not an array; the parser reports the latter)."""
    if not head:
        return None
    b = head[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    size = {0xDC: 2, 0xDD: 4}.get(b)
    if size is None or len(head) < 1 + size:
        return None
    return int.from_bytes(head[1:1 + size], "big")


class ByteBudget:
    """Bytes of push bodies held in memory by all requests together, shown by
    ``gauge`` (anything with ``set(value)``) when given."""

    def __init__(self, limit: int, gauge: Any = None) -> None:
        self.limit, self.used, self._gauge = limit, 0, gauge

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise PushBusyError(
                f"the service holds {self.used} bytes of push bodies, its bound is {self.limit}: "
                "retry after Retry-After seconds"
            )
        self.used += n
        if self._gauge is not None:
            self._gauge.set(self.used)

    def give(self, n: int) -> None:
        self.used -= n
        if self._gauge is not None:
            self._gauge.set(self.used)


async def read_body(content: StreamReader, content_type: str, limits: BodyLimits,
                    budget: ByteBudget) -> bytes:
    """The whole body, refused with 413 as soon as it passes a limit, or with 503 when
    the bodies of all requests together would pass ``budget``. The bytes stay taken
    from ``budget``: the caller gives back ``len(body)`` when done with it."""
    chunks: list[bytes] = []
    size = newlines = 0
    deadline = time.monotonic() + limits.total_timeout_s
    head = b""
    try:
        while True:
            timeout = min(limits.chunk_timeout_s, deadline - time.monotonic())
            try:
                chunk = await asyncio.wait_for(content.readany(), max(timeout, 0.0))
            except TimeoutError as exc:
                raise PushTooSlowError(
                    f"the body did not arrive in time (each chunk within {limits.chunk_timeout_s} "
                    f"s, the whole body within {limits.total_timeout_s} s); send it at once"
                ) from exc
            if not chunk:
                break
            size += len(chunk)
            if size > limits.max_bytes:
                raise PushTooLargeError(
                    f"the body is over {limits.max_bytes} bytes: the limit per request; send "
                    "smaller batches"
                )
            if content_type == NDJSON_TYPE:
                newlines += chunk.count(b"\n")
                if newlines > limits.max_records:
                    raise _too_many(limits, f"more than {limits.max_records}")
            elif content_type in MSGPACK_TYPES and len(head) < 5:
                head += chunk[:5]
                count = _msgpack_array_len(head)
                if count is not None and count > limits.max_records:
                    raise _too_many(limits, str(count))
            budget.take(len(chunk))
            chunks.append(chunk)
    except BaseException:
        budget.give(sum(len(c) for c in chunks))
        raise
    return b"".join(chunks)


def _encode(value: object, where: str, max_record_bytes: int) -> dict[bytes, bytes]:
    try:
        fields = streams.encode_record(value)
    except streams.ContractError as exc:
        raise MalformedPushError(f"{where}: {exc}") from exc
    size = streams.record_size(fields)
    if size > max_record_bytes:
        raise PushTooLargeError(f"{where} is {size} bytes: the limit is {max_record_bytes} per record")
    return fields


def _json_value(decode: json.JSONDecoder, text: str, start: int, where: str) -> tuple[object, int]:
    try:
        return decode.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise MalformedPushError(f"{where} is not valid JSON: {exc.msg} at character {exc.pos}") from exc
    except RecursionError as exc:
        raise MalformedPushError(f"{where} is nested too deeply to decode") from exc
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise MalformedPushError(f"{where} is not valid JSON: {exc}") from exc


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


Steps = Generator[None, None, list[tuple[str, object]]]
_SLICE_RECORDS = 64
_SLICE_CHARS = 128 * 1024


class _Pacer:
    """Says when a parsing slice has done enough work to hand the loop back."""

    def __init__(self) -> None:
        self.records = self.chars = 0

    def due(self, chars: int) -> bool:
        self.records += 1
        self.chars += chars
        if self.records >= _SLICE_RECORDS or self.chars >= _SLICE_CHARS:
            self.records = self.chars = 0
            return True
        return False


def _ndjson(body: bytes, decoder: json.JSONDecoder, limits: BodyLimits) -> Steps:
    values: list[tuple[str, object]] = []
    pacer = _Pacer()
    pos, lineno = 0, 0
    while pos < len(body):
        end = body.find(b"\n", pos)
        end = len(body) if end < 0 else end
        raw, pos, lineno = body[pos:end], end + 1, lineno + 1
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedPushError(f"line {lineno} is not UTF-8 text: {exc}") from exc
        value, stop = _json_value(decoder, line, _skip_ws(line, 0), f"line {lineno}")
        if _skip_ws(line, stop) != len(line):
            raise MalformedPushError(f"line {lineno} holds more than one JSON value")
        values.append((f"line {lineno}", value))
        if len(values) > limits.max_records:
            raise _too_many(limits, f"more than {limits.max_records}")
        if pacer.due(len(line)):
            yield
    return values


def _json_array(body: bytes, decoder: json.JSONDecoder, limits: BodyLimits) -> Steps:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPushError(f"the body is not UTF-8 text: {exc}") from exc
    i = _skip_ws(text, 0)
    if i == len(text) or text[i] != "[":
        raise MalformedPushError("an application/json body must be one array of records: [r0, r1, ...]")
    values: list[tuple[str, object]] = []
    pacer = _Pacer()
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        i += 1
    else:
        while True:
            where = f"record {len(values)}"
            start = i
            value, i = _json_value(decoder, text, i, where)
            values.append((where, value))
            if len(values) > limits.max_records:
                raise _too_many(limits, f"more than {limits.max_records}")
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
                if pacer.due(i - start):
                    yield
                continue
            if i < len(text) and text[i] == "]":
                i += 1
                break
            raise MalformedPushError(f"the JSON array is not closed after record {len(values) - 1}")
    if _skip_ws(text, i) != len(text):
        raise MalformedPushError("the body holds more after the JSON array")
    return values


def _msgpack(body: bytes, limits: BodyLimits) -> Steps:
    unpacker = msgpack.Unpacker(
        raw=False, max_buffer_size=max(len(body), 1), max_array_len=limits.max_records,
        max_map_len=limits.max_records, strict_map_key=True,
    )
    unpacker.feed(body)
    values: list[tuple[str, object]] = []
    pacer = _Pacer()
    try:
        count = unpacker.read_array_header()
        if count > limits.max_records:
            raise _too_many(limits, str(count))
        for n in range(count):
            before = unpacker.tell()
            values.append((f"record {n}", unpacker.unpack()))
            if pacer.due(unpacker.tell() - before):
                yield
    except msgpack.OutOfData as exc:
        raise MalformedPushError("the msgpack body ends inside its array") from exc
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as exc:
        raise MalformedPushError(
            f"body is not valid msgpack, or not an array of records ({type(exc).__name__}: {exc})"
        ) from exc
    if unpacker.tell() != len(body):
        raise MalformedPushError("the msgpack body holds more after its array of records")
    return values


def _parse(body: bytes, content_type: str, max_record_bytes: int,
           limits: BodyLimits) -> Generator[None, None, list[dict[bytes, bytes]]]:
    if content_type in MSGPACK_TYPES:
        values = yield from _msgpack(body, limits)
    elif content_type == JSON_TYPE:
        values = yield from _json_array(body, json.JSONDecoder(), limits)
    else:
        values = yield from _ndjson(body, json.JSONDecoder(), limits)
    if not values:
        raise MalformedPushError("the body holds no record: expected at least one")
    records: list[dict[bytes, bytes]] = []
    pacer = _Pacer()
    for where, value in values:
        records.append(_encode(value, where, max_record_bytes))
        if pacer.due(len(records[-1].get(streams.F_DATA, b""))):
            yield
    return records


async def parse_records_sliced(body: bytes, content_type: str, max_record_bytes: int,
                               limits: BodyLimits, *, share: float = 1.0
                               ) -> list[dict[bytes, bytes]]:
    """The records of a push body, encoded as stream entries; raises MalformedPushError
    (400) or PushTooLargeError (413) naming the offending record. Runs on the event
    loop, handing it back after every slice of at most 64 records or 128 KiB of text,
    so other requests are served between slices. With ``share`` below 1 it rests
    after each slice, so that it takes at most that share of the loop's time."""
    steps = _parse(body, content_type, max_record_bytes, limits)
    rest = (1.0 - share) / share
    while True:
        started = time.perf_counter()
        try:
            next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        await asyncio.sleep((time.perf_counter() - started) * rest)
