"""Hand-packed RESP commands for the producer's hot path.

redis-py packs every argument in Python and joins buffers per command; for batches of
many records that packing, not Redis, was the producer's bottleneck. Here a batch is a
list of byte chunks (headers, then each payload as is) written in one go on a
connection of the client's own pool, so payload bytes are never re-encoded; and its
replies are read in one loop (see ``_drain_hiredis``), not one redis-py call each.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import operator
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ingest_service import redis_client
from ingest_service.errors import NotReplicatedError
from trainguard.core import streams

try:
    import hiredis
    from redis._parsers.hiredis import NOT_ENOUGH_DATA as _NOT_ENOUGH_DATA
except ImportError:  # redis-py without hiredis, or a redis-py that moved its parser
    _NOT_ENOUGH_DATA = None

__all__ = [
    "bulk", "evalsha_head", "evalsha_parts", "call_packed_script", "call_packed_scripts",
    "xadd_records", "Link", "honour_cancel",
]


def evalsha_head(sha: bytes, keys: Sequence[bytes], nargs: int) -> bytes:
    """``EVALSHA sha numkeys keys...`` as RESP, for a command of ``nargs`` args to follow."""
    n = b"%d" % len(keys)
    return b"".join([b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n" % (3 + len(keys) + nargs, len(sha), sha),
                     bulk(n), *(bulk(k) for k in keys)])


def evalsha_parts(sha: bytes, keys: Sequence[bytes], args: Sequence[bytes]) -> list[bytes]:
    """``EVALSHA sha numkeys keys... args...`` as RESP chunks."""
    parts = [evalsha_head(sha, keys, len(args))]
    for item in args:
        if len(item) < 512:
            parts.append(b"$%d\r\n%s\r\n" % (len(item), item))
        else:  # large payloads are not copied into a header string
            parts.append(b"$%d\r\n" % len(item))
            parts.append(item)
            parts.append(b"\r\n")
    return parts


async def call_packed_script(
    redis: Redis, script: str, sha: bytes, keys: Sequence[bytes], args: Sequence[bytes],
    *, replicas: int | None = 0, wait_ms: int = 1000, wait_aof: bool = False,
) -> object:
    """One script call: :func:`call_packed_scripts` with one argument list."""
    (reply,) = await call_packed_scripts(redis, script, sha, keys, [evalsha_parts(sha, keys, args)],
                                         replicas=replicas, wait_ms=wait_ms, wait_aof=wait_aof)
    return reply


async def call_packed_scripts(
    redis: Redis, script: str, sha: bytes, keys: Sequence[bytes], calls: Sequence[list[bytes]],
    *, replicas: int | None = 0, wait_ms: int = 1000, wait_aof: bool = False,
) -> list[object]:
    """Run ``calls`` (each ``evalsha_parts(sha, keys, ...)``, all on the same ``keys``)
    pipelined on one pooled connection to the master of ``keys[0]``'s slot, in order;
    their replies. When Redis lost the script (NOSCRIPT after a restart or failover),
    loads it and sends again from the first call that found it missing (the calls before
    it ran; a call after it that ran anyway appended nothing, as the scripts that
    pipeline are idempotent in order). Another error reply is raised after all replies
    are read; connection errors propagate (the caller syncs again).

    ``replicas``: return only once ``WAIT`` saw that many replicas take the writes (None:
    one when the master has a replica, else none), else raise
    :class:`NotReplicatedError`. Replication is asynchronous: a write only the master
    holds is lost when its replica is promoted, so a push is acknowledged only once a
    replica has it. The calls must write (WAIT counts this connection's writes).
    ``wait_aof``: where no replica is waited for, return only once the server's own
    append-only file has the writes on disk (``WAITAOF 1 0``, Redis 7.2 on)."""
    pool = await redis_client.pool_for(redis, keys[0].decode())
    try:
        conn = await pool.get_connection()
    except redis_client.TRANSIENT:
        await redis_client.refresh(redis)  # the master may have changed: look again
        raise
    try:
        replies: list[object] = []
        pending = list(calls)
        loaded = False
        while pending:
            # Call by call (each at most a slice, ~512 KiB), still pipelined: one write
            # of all the calls was joined into one bytes (asyncio's writelines) and then
            # copied into the transport's buffer, 45 ms of the loop for a 15 MiB batch.
            for call in pending:
                await conn.send_packed_command(call, check_health=False)
            got: list[object] = []
            for _ in pending:
                try:
                    got.append(await conn.read_response())
                except ResponseError as exc:  # read whole: the connection stays in step
                    got.append(exc)
            missing = next((i for i, r in enumerate(got) if isinstance(r, NoScriptError)), None)
            if missing is None or loaded:
                replies += got
                break
            replies += got[:missing]
            pending = pending[missing:]
            await conn.send_command("SCRIPT", "LOAD", script)
            await conn.read_response()
            loaded = True
        if not any(isinstance(r, ResponseError) for r in replies):
            waited = replicas != 0 and await _wait_replicas(conn, replicas, wait_ms)
            if wait_aof and not waited:
                await _wait_aof(conn, wait_ms)
    except BaseException as exc:
        # A reply may still be on its way (cancelled, or a broken link): this
        # connection must not be reused.
        await conn.disconnect()
        if isinstance(exc, redis_client.TRANSIENT):
            await redis_client.refresh(redis)
        raise
    finally:
        await pool.release(conn)
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


_ROLE_TTL_S = 10.0
_replica_counts: dict[tuple[str, str], tuple[float, int]] = {}


_AOF_WAIT_MS = 2500
"""At least this long for the local fsync: with appendfsync everysec it comes within
about a second."""


async def _wait_aof(conn: Any, wait_ms: int) -> None:
    wait_ms = max(wait_ms, _AOF_WAIT_MS)
    await conn.send_command("WAITAOF", 1, 0, wait_ms)
    local, _ = await conn.read_response()
    if int(local) < 1:
        raise NotReplicatedError(
            f"the batch is in Redis but not yet in its append-only file on disk after "
            f"{wait_ms} ms: a crash now could lose it. Retry with the same seq (a batch "
            "already appended is not appended twice)")


async def _wait_replicas(conn: Any, replicas: int | None, wait_ms: int) -> bool:
    """Whether it waited for a replica (raises NotReplicatedError when none took the
    writes in time)."""
    if replicas is None:
        replicas = await _has_replica(conn)
        if not replicas:
            return False
    await conn.send_command("WAIT", replicas, wait_ms)
    acked = int(await conn.read_response())
    if acked < replicas:
        raise NotReplicatedError(
            f"the batch is on the master but {acked} of the {replicas} replica(s) asked for "
            f"confirmed it within {wait_ms} ms: a failover now could lose it. Retry with the "
            "same seq (a batch already appended is not appended twice)"
        )
    return True


async def _has_replica(conn: Any) -> int:
    """1 when the server of ``conn`` is a master with a replica, else 0. Asked with ROLE
    at most every ``_ROLE_TTL_S`` per server (a push to one Redis without replicas
    should not pay a round trip for it); a master that gains or loses a replica is seen
    within that time."""
    server = (str(getattr(conn, "host", "")), str(getattr(conn, "port", getattr(conn, "path", ""))))
    now = time.monotonic()
    cached = _replica_counts.get(server)
    if cached is not None and now - cached[0] < _ROLE_TTL_S:
        return cached[1]
    await conn.send_command("ROLE")
    role = await conn.read_response()
    count = min(1, len(role[2])) if role[0] in (b"master", "master") else 0
    _replica_counts[server] = (now, count)
    return count


_NOMKSTREAM = b"$10\r\nNOMKSTREAM\r\n"


def honour_cancel() -> None:
    """Re-raise a cancellation that redis-py swallowed inside a call (it catches
    CancelledError in some connect/read paths): a task asked to stop must stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancelled during a Redis call")


_D = b"$%d\r\n%b\r\n" % (len(streams.F_DATA), streams.F_DATA)
_POS = b"$%d\r\n%b\r\n" % (len(streams.F_POS), streams.F_POS)
_CRLF = b"\r\n"


_INLINE_MAX = 1024
"""Payloads up to this size are formatted into their batch's bytes: copying a small
payload costs less than a list item (and a Python step) of its own."""
_DATA, _POS_OF, _META = (operator.itemgetter(i) for i in range(3))


def xadd_records(
    parts: list[bytes], key_bulk: bytes, ms: int, first: int, records: Sequence[Any],
    *, nomkstream: bool,
) -> None:
    """Append ``XADD key [NOMKSTREAM] <ms>-<first + i> <meta...> pos <pos> d <data>``
    for each of ``records`` (``sources.GoodRecord``: ``data``, ``pos``, ``meta``) to
    ``parts``; ``key_bulk`` is the key already as a RESP bulk string.

    Small records of one layout (the common case: every record of a source shares its
    ``meta``) are encoded by one ``%`` of a per-record template repeated over the
    batch, its arguments gathered by C iterators: no Python step per record. Otherwise
    each payload goes in as its own chunk, never copied here; the rest of a record is
    one formatted chunk, and the parts shared by records of one layout are encoded
    once."""
    if not records:
        return
    metas = list(map(_META, records))
    if (metas.count(metas[0]) == len(metas)
            and max(map(len, map(_DATA, records))) <= _INLINE_MAX):
        _xadd_inline(parts, key_bulk, ms, first, records, nomkstream=nomkstream)
    else:
        _xadd_chunks(parts, key_bulk, ms, first, records, nomkstream=nomkstream)


def _head(key_bulk: bytes, meta: Any, nomkstream: bool) -> tuple[bytes, bytes]:
    """A record's bytes before its ID, and its fields between the ID and ``pos``."""
    argc = 3 + (1 if nomkstream else 0) + 2 * (len(meta) + 2)
    head = b"*%d\r\n$4\r\nXADD\r\n%b%b" % (argc, key_bulk, _NOMKSTREAM if nomkstream else b"")
    return head, b"".join(bulk(k) + bulk(v) for k, v in meta) + _POS


def _xadd_inline(
    parts: list[bytes], key_bulk: bytes, ms: int, first: int, records: Sequence[Any],
    *, nomkstream: bool,
) -> None:
    head, fields = _head(key_bulk, records[0].meta, nomkstream)
    lo, end = first, first + len(records)
    while lo < end:
        # One template per ID length: the ID's bulk header holds its length.
        digits = len(b"%d" % lo)
        hi = min(end, 10**digits)
        run = records[lo - first : hi - first]
        template = (
            (head + b"$%d\r\n%d-" % (len(b"%d-" % ms) + digits, ms)).replace(b"%", b"%%")
            + b"%d\r\n" + fields.replace(b"%", b"%%") + b"$%d\r\n%b\r\n"
            + _D + b"$%d\r\n%b\r\n"
        )
        pos = list(map(_POS_OF, run))
        data = list(map(_DATA, run))
        args = tuple(itertools.chain.from_iterable(
            zip(range(lo, hi), map(len, pos), pos, map(len, data), data)))
        parts.append(template * len(run) % args)
        lo = hi


def _xadd_chunks(
    parts: list[bytes], key_bulk: bytes, ms: int, first: int, records: Sequence[Any],
    *, nomkstream: bool,
) -> None:
    meta: Any = None
    head = fields = b""
    # The ID's length, kept by counting digits instead of formatting the ID apart.
    ms_len = len(b"%d-" % ms)
    digits = len(b"%d" % first)
    next_digit = 10**digits
    append = parts.append
    for index, rec in enumerate(records, first):
        if rec.meta is not meta:
            meta = rec.meta
            head, fields = _head(key_bulk, meta, nomkstream)
        if index >= next_digit:
            digits += 1
            next_digit *= 10
        pos = rec.pos
        data = rec.data
        append(b"%b$%d\r\n%d-%d\r\n%b$%d\r\n%b\r\n%b$%d\r\n" % (
            head, ms_len + digits, ms, index, fields, len(pos), pos, _D, len(data)))
        append(data)
        append(_CRLF)


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


class Link:
    """One writer's own connection for one epoch, never silently reconnected.

    redis-py reconnects (and may resend) transparently; for appends with explicit IDs
    that could write after a gap into a Redis that restarted and lost data. A Link
    refuses instead: once its connection broke, every call raises redis' ConnectionError, and
    the producer syncs again (re-reading every partition's last ID) before it opens
    new links.
    """

    def __init__(self, redis: Redis, key: str | None = None) -> None:
        self._redis = redis
        self._key = key
        self._pool: Any = None
        self._conn: Any = None
        self._drain = _drain_each

    async def open(self) -> None:
        """Take a connection to the server of ``key`` (any key of the Redis when None:
        on a cluster, a link serves the partitions of one master)."""
        if self._key is None:
            self._pool = self._redis.connection_pool
        else:
            self._pool = await redis_client.pool_for(self._redis, self._key)
        self._conn = await self._pool.get_connection()
        # Decided once: a Link's connection (and so its parser) never changes.
        self._drain = _drain_hiredis if _hiredis_reader(self._conn) is not None else _drain_each
        honour_cancel()

    def _live(self) -> Any:
        if self._conn is None or not self._conn.is_connected:
            raise RedisConnectionError("the connection to Redis broke: syncing again")
        return self._conn

    async def call(self, *args: Any) -> Any:
        conn = self._live()
        await conn.send_command(*args, check_health=False)
        reply = await conn.read_response()
        honour_cancel()
        return reply

    async def send_many(self, parts: list[bytes], replies: int) -> list[Any]:
        """Send pre-packed commands, read their replies (error replies as exceptions).

        One deadline for the whole batch (the connection's socket timeout, else 60 s)
        instead of one per reply: per-reply timers cost more than the replies."""
        conn = self._live()
        await conn.send_packed_command(parts, check_health=False)
        deadline = conn.socket_timeout or 60.0
        try:
            async with asyncio.timeout(deadline):
                out = await self._drain(conn, replies)
        except TimeoutError as exc:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError(f"no reply from Redis within {deadline} s") from exc
        honour_cancel()
        return out

    async def close(self, *, broken: bool) -> None:
        if self._conn is None:
            return
        if broken:
            await self._conn.disconnect()
        await self._pool.release(self._conn)
        self._conn = None


# Reading a batch's replies. redis-py's read_response costs microseconds of Python per
# reply (timeouts, health checks, push handling); for thousands of XADD replies a
# second that was the producer's largest cost after packing. With hiredis (a
# dependency) the replies of a whole batch are taken from the parser's own
# hiredis.Reader in one loop. That reaches into redis-py's parser, so it is checked:
# ``test_batch_replies_take_the_hiredis_path`` fails if a redis-py upgrade moves it,
# and anything unexpected falls back to one read_response per reply.


def _hiredis_reader(conn: Any) -> Any:
    """The connection's hiredis.Reader if its parser is redis-py's hiredis parser, else
    None."""
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if (
        _NOT_ENOUGH_DATA is None
        or not isinstance(reader, hiredis.Reader)
        or not hasattr(parser, "read_from_socket")
        or not hasattr(parser, "handle_push_response")
    ):
        return None
    return reader


async def _drain_hiredis(conn: Any, replies: int) -> list[Any]:
    parser = conn._parser
    gets = parser._reader.gets
    # RESP3 (redis-py's default) may put a push message (e.g. a maintenance notice)
    # between replies: it goes to redis-py's handler and is not a reply.
    push = getattr(hiredis, "PushNotification", None)
    out: list[Any] = []
    append = out.append
    try:
        while len(out) < replies:
            reply = gets(False)
            if reply is _NOT_ENOUGH_DATA:
                await parser.read_from_socket()
            elif push is not None and reply.__class__ is push:
                await parser.handle_push_response(reply)
            else:
                append(reply)
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise RedisConnectionError(f"error while reading from Redis: {exc}") from exc
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    for reply in out:
        if isinstance(reply, RedisConnectionError):
            await conn.disconnect(nowait=True)
            raise reply
    return out


async def _drain_each(conn: Any, replies: int) -> list[Any]:
    out: list[Any] = []
    for _ in range(replies):
        try:
            out.append(await conn.read_response(disable_decoding=True, timeout=math.inf))
        except ResponseError as exc:
            out.append(exc)
    return out
