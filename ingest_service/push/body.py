"""A push body parsed into stream entries (its limits, :class:`BodyLimits`, are
:mod:`~ingest_service.push.limits`'s; reading it, :mod:`~ingest_service.push.read`'s).

Big or container-heavy bodies are parsed by :func:`parse_records` in a decode worker
process (:mod:`~ingest_service.push.decode_pool`); the others (and every body with
``decode_workers`` 0) here, on the loop.
Parsing (:func:`parse_records_sliced`) runs on the event loop in slices: it decodes
record by record (one JSON line, one element of a JSON array, one msgpack item per
call) and hands the loop back after every 64 records, 32 KiB of JSON (about a
millisecond), 128 KiB of msgpack or 4,096 msgpack lists and maps, with the garbage
collector paused in each slice; a msgpack body of at most 128 KiB within one record's
bounds is decoded in one call; a bigger one is read by the
unpacker 64 KiB at a time (not copied into its buffer whole) and, given as the
bytearray :func:`~ingest_service.push.read.read_body` fills, consumed as it is read. A record's containers and
nesting are bounded while it is decoded (:mod:`ingest_service.push.bounds`: 413), so
no one record holds the loop either. Each record is encoded into its
stream entry as soon as it is decoded (decoded values do not pile up for the garbage
collector). Bodies over ``big_body_bytes`` (1 MiB; an RL batch is a fraction of that) parse one at a time and rest between slices, together taking at most
a quarter of the loop: a client sending the worst case in a loop slows itself, not the
others. A slice that took over ``heavy_slice_cpu_ms`` of CPU (one record of thousands
of lists, decoded in one call) rests the same way in a body of any size: a request
served meanwhile needs several loop turns, and gets them behind one such slice. (Not worker threads: a thread parsing a big body holds the GIL
for 5 ms turns, and every wake-up of the loop then waits a turn; under load that
added up to seconds.)

Content types: ``application/x-ndjson`` (one JSON value per line), ``application/json``
(one array of records), ``application/msgpack`` (one array; ``bin`` items stay raw
bytes). Anything else is 415. Malformed numbers (integers over 64 bits or thousands
of digits) and undecodable text are 400; a record of more than
``max_record_containers`` lists and maps, or nested deeper than ``max_record_depth``,
is 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re
import time
from collections.abc import Generator
from dataclasses import dataclass

import msgpack

from ingest_service.errors import (
    MalformedPushError,
    PushRejectedError,
)
from ingest_service.push.bounds import BoundsOverflow, MsgpackBounds, needs_scan, scan_json
from ingest_service.push.digest import BatchDigest
from ingest_service.push.entries import (
    ENCODE_SLICE_RECORDS,
    SLICE_CHARS,
    SLICE_TEXT,
    Body,
    Entries,
    Pacer,
    Steps,
    label,
)
from ingest_service.push.limits import BodyLimits, too_many
from trainguard.core import push_wire

__all__ = [
    "CONTENT_TYPES",
    "JSON_TYPE",
    "MSGPACK_TYPES",
    "NDJSON_TYPE",
    "BatchDigest",
    "BodyLimits",
    "ParsedBatch",
    "parse_records",
    "parse_records_sliced",
    "too_many",
    "msgpack_array_len",
]

NDJSON_TYPE = "application/x-ndjson"
JSON_TYPE = "application/json"
MSGPACK_TYPES = (push_wire.MSGPACK_TYPE, "application/x-msgpack", "application/vnd.msgpack")
CONTENT_TYPES = (NDJSON_TYPE, JSON_TYPE, *MSGPACK_TYPES)


def msgpack_array_len(head: bytes | bytearray) -> int | None:
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


@dataclass(frozen=True)
class ParsedBatch:
    """A push body's records as stream entries, with their sizes counted once."""

    records: list[dict[bytes, bytes]]
    sizes: list[int]
    """Per record, its entry's bytes (field names and values): what bounds a slice."""
    data_bytes: int
    """The payloads' bytes (the ``d`` fields), as the backlog counts them."""
    digest: str
    """:class:`BatchDigest` of the records: what tells this batch from another."""


def _json_value(decode: json.JSONDecoder, text: str, start: int, where: str) -> tuple[object, int]:
    try:
        return decode.raw_decode(text, start)
    except json.JSONDecodeError as exc:
        raise MalformedPushError(f"{where} is not valid JSON: {exc.msg} at character {exc.pos}") from exc
    except RecursionError as exc:
        raise MalformedPushError(f"{where} is nested too deeply to decode") from exc
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise MalformedPushError(f"{where} is not valid JSON: {exc}") from exc


_WS = re.compile(rb"[ \t\r\n]*")


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


_SCAN_ALWAYS = 1024 * 1024
"""Characters of a JSON array body from which each record is scanned, uncounted."""


def _ndjson(body: Body, decoder: json.JSONDecoder, out: Entries) -> Steps:
    pacer = Pacer(SLICE_TEXT)
    shape = (out.limits.max_record_containers, out.limits.max_record_depth)
    pos, lineno = 0, 0
    view = memoryview(body)  # lines decoded from it: no copy of each line's bytes first
    while pos < len(body):
        end = body.find(b"\n", pos)
        end = len(body) if end < 0 else end
        start, pos, lineno = pos, end + 1, lineno + 1
        first = _WS.match(body, start, end).end()  # type: ignore[union-attr]
        if first == end:
            continue  # a blank line
        # Its bytes scanned before they are decoded: a bomb is never decoded at all. (A
        # long line is scanned without counting its brackets first: the count is a pass
        # over it in one slice, the scan yields.)
        if body[first:first + 1] in (b"[", b"{") and (
                end - first > SLICE_TEXT or needs_scan(body, *shape, first, end)):
            yield from scan_json(body, first, f"line {lineno}", *shape, end=end)
        try:
            line = str(view[first:end], "utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedPushError(f"line {lineno} is not UTF-8 text: {exc}") from exc
        value, stop = _json_value(decoder, line, 0, f"line {lineno}")
        if _skip_ws(line, stop) != len(line):
            raise MalformedPushError(f"line {lineno} holds more than one JSON value")
        out.add(value, lineno)
        if pacer.due(len(line)):
            yield


_SCALAR = re.compile(rb'"(?:[^"\\]|\\.)*"|[^,\]\s]+', re.S)
"""A record that is not a container: a string, or a number or literal up to the next
comma, bracket or space (what it holds is the decoder's to check)."""


def _json_array_bytes(body: Body, decoder: json.JSONDecoder, out: Entries) -> Steps:
    """A JSON array body over 1 MiB read from its bytes, record by record: each
    record's extent found by the scan of its brackets (done for every record of such a
    body anyway), and only that record's text decoded. Decoded whole first, the body
    was copied into a str of its size: it cost twice its size while parsed."""
    view, shape = memoryview(body), (out.limits.max_record_containers, out.limits.max_record_depth)
    i = _WS.match(body).end()  # type: ignore[union-attr]
    if body[i:i + 1] != b"[":
        raise MalformedPushError("an application/json body must be one array of records: [r0, r1, ...]")
    pacer = Pacer(SLICE_TEXT)
    i = _WS.match(body, i + 1).end()  # type: ignore[union-attr]
    if body[i:i + 1] == b"]":
        i += 1
    else:
        while True:
            start, n = i, len(out.records)
            where = label("record", n)
            if body[i:i + 1] in (b"[", b"{"):
                end = yield from scan_json(body, i, where, *shape)
            else:
                m = _SCALAR.match(body, i)
                end = m.end() if m else i + 1  # then one character, for the decoder to refuse
            end = len(body) if end is None else end  # not well-formed: the decoder says how
            try:
                text = str(view[start:end], "utf-8")
            except UnicodeDecodeError as exc:
                raise MalformedPushError(f"{where} is not UTF-8 text: {exc}") from exc
            value, stop = _json_value(decoder, text, 0, where)
            if stop != len(text):
                raise MalformedPushError(f"{where} is not valid JSON: it ends at character "
                                         f"{stop} of its {len(text)}")
            out.add(value, n)
            i = _WS.match(body, end).end()  # type: ignore[union-attr]
            if body[i:i + 1] == b",":
                i = _WS.match(body, i + 1).end()  # type: ignore[union-attr]
                if pacer.due(i - start):
                    yield
                continue
            if body[i:i + 1] == b"]":
                i += 1
                break
            raise MalformedPushError(f"the JSON array is not closed after record {n}")
    if _WS.match(body, i).end() != len(body):  # type: ignore[union-attr]
        raise MalformedPushError("the body holds more after the JSON array")


def _json_array(body: Body, decoder: json.JSONDecoder, out: Entries) -> Steps:
    if len(body) > _SCAN_ALWAYS:
        yield from _json_array_bytes(body, decoder, out)
        return
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedPushError(f"the body is not UTF-8 text: {exc}") from exc
    i = _skip_ws(text, 0)
    if i == len(text) or text[i] != "[":
        raise MalformedPushError("an application/json body must be one array of records: [r0, r1, ...]")
    pacer = Pacer(SLICE_TEXT)
    shape = (out.limits.max_record_containers, out.limits.max_record_depth)
    yield  # decoding a big body took milliseconds already: the loop's turn
    # The body's own array is one container more, one level deeper. (A big body is
    # scanned without counting first, as a long NDJSON line is.)
    scan = len(text) > _SCAN_ALWAYS or needs_scan(text, shape[0] + 1, shape[1] + 1)
    i = _skip_ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        i += 1
    else:
        while True:
            start, n = i, len(out.records)
            if scan and text[i:i + 1] in ("[", "{"):
                yield from scan_json(text, i, label("record", n), *shape)
            value, i = _json_value(decoder, text, i, label("record", n))
            out.add(value, n)
            i = _skip_ws(text, i)
            if i < len(text) and text[i] == ",":
                i = _skip_ws(text, i + 1)
                if pacer.due(i - start):
                    yield
                continue
            if i < len(text) and text[i] == "]":
                i += 1
                break
            raise MalformedPushError(f"the JSON array is not closed after record {n}")
    if _skip_ws(text, i) != len(text):
        raise MalformedPushError("the body holds more after the JSON array")


_UNSET = object()


class _Reader:
    """A body read by the unpacker a slice at a time (``read``, as a file is): fed the
    whole body, the unpacker copied it into its own buffer, a second copy of every big
    body while it was parsed. A bytearray body is consumed as it is read (its front
    cut off), so the records decoded from it take the room it gives back: a body and
    its records are not both in memory whole."""

    def __init__(self, body: Body) -> None:
        self._body, self._pos = body, 0

    def read(self, n: int) -> bytes:
        body = self._body
        if isinstance(body, bytearray):
            chunk = bytes(body[:n])
            del body[:n]  # CPython moves the start, and shrinks it once half is gone
            return chunk
        start = self._pos
        self._pos = min(len(body), start + n)
        return bytes(body[start:self._pos])


_READ_BYTES = 64 * 1024


def _unpacker(body: Body, limits: BodyLimits, bounds: MsgpackBounds, *, whole: bool
              ) -> msgpack.Unpacker:
    """An unpacker of ``body``: fed it ``whole`` (a small body, one copy), else reading
    it in slices of 64 KiB (its buffer then holds a slice and the record under way)."""
    options: dict[str, object] = dict(
        raw=False, max_buffer_size=max(len(body), _READ_BYTES), max_array_len=limits.max_records,
        max_map_len=limits.max_records, strict_map_key=True, list_hook=bounds.list_hook,
        object_hook=bounds.object_hook)
    if not whole:
        return msgpack.Unpacker(_Reader(body), read_size=_READ_BYTES, **options)
    items = msgpack.Unpacker(**options)
    items.feed(body)
    return items


def _msgpack(body: Body, out: Entries) -> Steps:
    limits = out.limits
    size = len(body)  # a big bytearray body is consumed while it is read
    count = msgpack_array_len(body[:5])
    if count is not None and count > limits.max_records:
        raise too_many(limits, str(count))
    # The whole body of a small one within the bounds of one record (and one level
    # more, the body's array), else record by record, each within its own.
    bounds = MsgpackBounds(limits.max_record_containers, limits.max_record_depth + 1)
    n = 0
    try:
        array: object = _UNSET
        if len(body) <= SLICE_CHARS:
            items = _unpacker(body, limits, bounds, whole=True)
            with contextlib.suppress(BoundsOverflow):  # then record by record: which one?
                array = items.unpack()
            if array is _UNSET:
                yield  # that try decoded up to a slice's containers already
        if array is not _UNSET:
            # One slice's worth: the array decoded in one call (item by item cost 20x as
            # much); encoded in slices of 256 records (a 100-record batch in one turn).
            if not isinstance(array, list):
                raise MalformedPushError(
                    f"the msgpack body is a {type(array).__name__}, not an array of records")
            for n, value in enumerate(array):
                out.add(value, n)
                if (n + 1) % ENCODE_SLICE_RECORDS == 0:
                    yield
        else:
            items = _unpacker(body, limits, bounds, whole=False)
            count = items.read_array_header()
            pacer = Pacer(SLICE_CHARS)
            for n in range(count):
                before = items.tell()
                bounds.reset(limits.max_record_containers, limits.max_record_depth)
                out.add(items.unpack(), n)
                if pacer.due(items.tell() - before, bounds.count):
                    yield
    except PushRejectedError:
        raise  # a record refused (400, 413): not a decoding error
    except BoundsOverflow as exc:
        raise bounds.error(exc, label("record", n)) from None
    except msgpack.StackError:  # deeper than the decoder's own stack: past ours too
        raise bounds.error(BoundsOverflow(True), label("record", n)) from None
    except msgpack.OutOfData as exc:
        raise MalformedPushError("the msgpack body ends inside its array") from exc
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise MalformedPushError(
            f"body is not valid msgpack, or not an array of records ({type(exc).__name__}: {exc})"
        ) from exc
    if items.tell() != size:
        raise MalformedPushError("the msgpack body holds more after its array of records")


def _parse(body: Body, content_type: str, max_record_bytes: int,
           limits: BodyLimits) -> Generator[None, None, ParsedBatch]:
    if content_type in MSGPACK_TYPES:
        out = Entries("record", max_record_bytes, limits)
        yield from _msgpack(body, out)
    elif content_type == JSON_TYPE:
        out = Entries("record", max_record_bytes, limits)
        yield from _json_array(body, json.JSONDecoder(), out)
    else:
        out = Entries("line", max_record_bytes, limits)
        yield from _ndjson(body, json.JSONDecoder(), out)
    if not out.records:
        raise MalformedPushError("the body holds no record: expected at least one")
    return ParsedBatch(out.records, out.sizes, out.data_bytes, out.digest.hexdigest())


async def parse_records_sliced(body: Body, content_type: str, max_record_bytes: int,
                               limits: BodyLimits, *, share: float = 1.0
                               ) -> ParsedBatch:
    """The records of a push body, encoded as stream entries (a big msgpack body given
    as a bytearray is consumed: empty on return); raises MalformedPushError
    (400) or PushTooLargeError (413) naming the offending record. Runs on the event
    loop, handing it back after every slice of at most 64 records or 32 KiB of JSON,
    so other requests are served between slices. With ``share`` below 1 it rests
    after each slice, so that it takes at most that share of the loop's time."""
    steps = _parse(body, content_type, max_record_bytes, limits)
    rest = (1.0 - share) / share
    heavy = max(rest, (1.0 - limits.big_body_share) / limits.big_body_share)
    while True:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            with _gc_paused():
                next(steps)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        cpu = time.thread_time() - cpu
        # A sleep(0) is one loop iteration, and a request served meanwhile needs several
        # (read, handler, write): behind slices of 4 ms each it waited one slice per step
        # (a /healthz 5-20x its p99). A rest (a timer) lets the loop run every ready step.
        if cpu * 1000 > limits.heavy_slice_cpu_ms:
            await asyncio.sleep(cpu * heavy)
        else:
            await asyncio.sleep((time.perf_counter() - started) * rest)


def parse_records(body: Body, content_type: str, max_record_bytes: int, limits: BodyLimits
                  ) -> ParsedBatch:
    """:func:`parse_records_sliced`'s parse in one go, with the garbage collector
    paused throughout: what a decode worker process runs
    (:mod:`~ingest_service.push.decode_worker`), where no loop waits for it."""
    steps = _parse(body, content_type, max_record_bytes, limits)
    with _gc_paused():
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]


@contextlib.contextmanager
def _gc_paused() -> Generator[None, None, None]:
    """The garbage collector off for one slice. A decode allocates a container per
    list or map, and every 700 allocations start a pass over the young objects: the
    record under way among them, and every tenth pass the older generations, the
    whole process's heap at times. That was 35 ms of a slice that does 6 ms of work
    (a JSON record of 10,000 lists). Decoded values hold no cycles: what a slice
    frees, reference counting frees."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
