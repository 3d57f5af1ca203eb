"""Where each partition of one producer stands: the last ID known to be in it, whether
the next batch may create its stream, and the retention floors to refill from when
Redis lost it. :meth:`Positions.sync` reads them from Redis; the producer moves them
past every batch it appends."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from redis.asyncio import Redis

from ingest_service import _lua
from ingest_service.backlog import min_committed
from ingest_service.producer.backpressure import Backpressure
from trainguard.core import streams

__all__ = ["NEVER", "Positions"]

log = logging.getLogger("ingest_service.producer.producer")

NEVER = 1 << 62
"""The next index of a partition that has nothing more to take in an epoch."""


class Positions:
    """The partitions' positions as this producer knows them (one list entry each)."""

    def __init__(self, partitions: int) -> None:
        self.last: list[streams.StreamId | None] = [None] * partitions
        """Last ID known to be in each partition (None: nothing)."""
        self.may_create: list[bool] = [True] * partitions
        self.floors: dict[int, streams.StreamId] = {}
        """Last retention floors seen: where to refill from when Redis lost a stream."""

    def next_index(self, partition: int, epoch: int, owned: frozenset[int]) -> int:
        """The first record of ``epoch`` that ``partition`` still needs (NEVER: none)."""
        if partition not in owned:
            return NEVER  # another producer's
        pos = self.last[partition]
        if pos is None or epoch > pos[0] - 1:
            return 0
        if epoch == pos[0] - 1:
            return pos[1] + 1
        return NEVER

    async def sync(self, redis: Redis, keys: Sequence[str], pressure: Backpressure,
                   lost: Callable[[int, str], None]) -> None:
        """Read every partition's last ID from Redis (and its backlog), calling
        ``lost(p, what)`` for each partition that ends below what was written."""
        async with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                # EVAL, not the registered script: a cluster pipeline refuses EVALSHA
                # through a Script, and a sync is rare enough to send the source.
                pipe.execute_command("EVAL", _lua.LAST_ID, 1, key)
            lasts = await pipe.execute()
        committed = await pressure.committed(force=True)
        for p, raw in enumerate(lasts):
            known = self.last[p]
            # An empty stream a trainer's consumer group created (MKSTREAM) before the
            # first record reports "0-0": nothing was written, as for no stream.
            if raw is not None and streams.parse_id(raw) == (0, 0):
                raw = None
            if raw is None:
                # A floor is where to refill from only for a stream this producer saw
                # (Redis lost what it wrote). A stream it never saw starts at the
                # source's beginning, whatever floors maintenance read meanwhile (the
                # floor hash and the stream have separate histories: on a cluster they
                # live on different masters); retention trims below the floor after.
                floor = self.floors.get(p) if known is not None else None
                if known is not None and (floor is None or known > floor):
                    lost(p, f"stream gone; refilling after {floor or 'the start'}")
                self.last[p] = floor
                self.may_create[p] = True
                pressure.backlogs[p].clear()
                continue
            last = streams.parse_id(raw)
            if known is not None and last < known:
                lost(p, f"stream ends at {streams.format_id(last)}, "
                        f"{streams.format_id(known)} was written; refilling")
            self.last[p] = last
            self.may_create[p] = False
            await pressure.backlogs[p].load(redis, keys[p], min_committed(committed, p))
