"""A producer writer's side of Redis: its links (one per server, never silently
reconnected), where a partition's stream ends, and one batch appended by pipelined
``XADD``s with explicit IDs. The producer keeps what it knows of each partition; this
module only talks to Redis and says what it found."""

from __future__ import annotations

from redis.asyncio import Redis

from ingest_service import _lua, redis_client
from ingest_service._resp import Link, xadd_records
from ingest_service.errors import StreamLostError
from ingest_service.sources.records import GoodRecord
from trainguard.core import streams

__all__ = ["Links", "append_batch", "check_end", "stream_end"]


class Links:
    """One writer's links, one per server: on a cluster a writer's partitions live on
    several masters. A link opens on first use."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._links: dict[str, Link] = {}

    async def get(self, key: str) -> Link:
        node = redis_client.node_name(self._redis, key)
        link = self._links.get(node)
        if link is None:
            link = self._links[node] = Link(self._redis, key)
            await link.open()
        return link

    async def close(self, *, broken: bool) -> None:
        for link in self._links.values():
            await link.close(broken=broken)


async def stream_end(link: Link, key: str) -> streams.StreamId | None:
    """The last ID of stream ``key``, on ``link``'s own connection (None: no stream)."""
    raw = await link.call("EVAL", _lua.LAST_ID, 1, key)
    return None if raw is None else streams.parse_id(raw)


async def check_end(link: Link, key: str, known: streams.StreamId | None, *,
                    may_create: bool) -> bool:
    """Stream ``key`` still ends at or after ``known`` (Redis lost nothing since the
    producer's sync); True when the stream exists. StreamLostError when it is gone but
    may not be created again, or ends before ``known``."""
    last = await stream_end(link, key)
    if last is None:
        if not may_create:
            raise StreamLostError(f"stream {key} is gone")
        return False
    if known is not None and last < known:
        raise StreamLostError(f"stream {key} ends at {streams.format_id(last)}, before "
                              f"{streams.format_id(known)}")
    return True


async def append_batch(link: Link, key: str, key_bulk: bytes, ms: int, first: int,
                       batch: list[GoodRecord], *, nomkstream: bool) -> int:
    """Pipelined ``XADD key [NOMKSTREAM] <ms>-<first + i> ...`` of one batch on the
    writer's link; returns how many entries were already there.

    NOMKSTREAM: a stream that vanished (deleted, or lost with its Redis) is never
    re-created behind the producer's back (StreamLostError). An XADD refused because
    its ID is not above the stream's last one means the entry is already there
    (another producer or a previous attempt); any other refusal is raised."""
    parts: list[bytes] = []
    xadd_records(parts, key_bulk, ms, first, batch, nomkstream=nomkstream)
    replies = await link.send_many(parts, len(batch))
    if None in replies:
        raise StreamLostError(f"stream {key} is gone")
    errors = [r for r in replies if r.__class__ is not bytes]
    if errors:
        end = await stream_end(link, key)
        if end is None or end < (ms, first + len(batch) - 1):
            raise errors[0]
    return len(errors)
