"""Hand-packed RESP commands for the producer's hot path.

redis-py packs every argument in Python and joins buffers per command; for batches of
many records that packing, not Redis, was the producer's bottleneck. Here a batch is a
list of byte chunks (headers, then each payload as is) written in one go on a
connection of the client's own pool, so payload bytes are never re-encoded.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["bulk", "evalsha_parts", "call_packed_script", "xadd_parts", "Link", "honour_cancel"]


def evalsha_parts(sha: bytes, keys: Sequence[bytes], args: Sequence[bytes]) -> list[bytes]:
    """``EVALSHA sha numkeys keys... args...`` as RESP chunks."""
    parts = [b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n" % (3 + len(keys) + len(args), len(sha), sha)]
    n = str(len(keys)).encode()
    parts.append(b"$%d\r\n%s\r\n" % (len(n), n))
    for item in (*keys, *args):
        if len(item) < 512:
            parts.append(b"$%d\r\n%s\r\n" % (len(item), item))
        else:  # large payloads are not copied into a header string
            parts.append(b"$%d\r\n" % len(item))
            parts.append(item)
            parts.append(b"\r\n")
    return parts


async def call_packed_script(
    redis: Redis, script: str, sha: bytes, keys: Sequence[bytes], args: Sequence[bytes]
) -> object:
    """Run a script by SHA on one pooled connection; loads it once if Redis lost it
    (NOSCRIPT after a restart). Connection errors propagate (the caller syncs again)."""
    pool = redis.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command(evalsha_parts(sha, keys, args), check_health=False)
        try:
            return await conn.read_response()
        except NoScriptError:
            pass
        await conn.send_command("SCRIPT", "LOAD", script)
        await conn.read_response()
        await conn.send_packed_command(evalsha_parts(sha, keys, args), check_health=False)
        return await conn.read_response()
    except BaseException:
        # A reply may still be on its way (cancelled, or a broken link): this
        # connection must not be reused.
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)


_NOMKSTREAM = b"$10\r\nNOMKSTREAM\r\n"


def honour_cancel() -> None:
    """Re-raise a cancellation that redis-py swallowed inside a call (it catches
    CancelledError in some connect/read paths): a task asked to stop must stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError("cancelled during a Redis call")


_KEY_BULKS: dict[bytes, bytes] = {}
"""Field names as RESP bulk strings: a stream's few field names recur in every entry."""


def _key_bulk(key: bytes) -> bytes:
    kb = _KEY_BULKS.get(key)
    if kb is None:
        kb = b"$%d\r\n%s\r\n" % (len(key), key)
        if len(_KEY_BULKS) < 1024:  # bounded: field names are few, but come from sources
            _KEY_BULKS[key] = kb
    return kb


def xadd_parts(
    parts: list[bytes], key_bulk: bytes, stream_id: bytes, fields: dict[bytes, bytes],
    *, nomkstream: bool,
) -> None:
    """Append ``XADD key [NOMKSTREAM] id field value...`` to ``parts``; ``key_bulk`` is
    the key already as a RESP bulk string. Small fields are joined into one chunk; large
    values go in as their own chunk, never copied here."""
    argc = 3 + 2 * len(fields) + (1 if nomkstream else 0)
    head = [
        b"*%d\r\n$4\r\nXADD\r\n%s%s$%d\r\n%s\r\n"
        % (argc, key_bulk, _NOMKSTREAM if nomkstream else b"", len(stream_id), stream_id)
    ]
    for k, v in fields.items():
        head.append(_key_bulk(k))
        n = len(v)
        if n < 512:
            head.append(b"$%d\r\n%s\r\n" % (n, v))
        else:
            head.append(b"$%d\r\n" % n)
            parts.append(b"".join(head))
            parts.append(v)
            head = [b"\r\n"]
    parts.append(b"".join(head))


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

    def __init__(self, redis: Redis) -> None:
        self._pool = redis.connection_pool
        self._conn: Any = None

    async def open(self) -> None:
        self._conn = await self._pool.get_connection()
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
        out: list[Any] = []
        try:
            async with asyncio.timeout(conn.socket_timeout or 60.0):
                for _ in range(replies):
                    try:
                        out.append(await conn.read_response(disable_decoding=True, timeout=math.inf))
                    except ResponseError as exc:
                        out.append(exc)
        except TimeoutError as exc:
            await conn.disconnect(nowait=True)
            raise RedisTimeoutError(f"no reply from Redis within {conn.socket_timeout or 60.0} s") from exc
        honour_cancel()
        return out

    async def close(self, *, broken: bool) -> None:
        if self._conn is None:
            return
        if broken:
            await self._conn.disconnect()
        await self._pool.release(self._conn)
        self._conn = None
