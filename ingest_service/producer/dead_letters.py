"""Dead letters: bad records (undecodable, oversized, schema) appended to the dataset's
dead-letter stream with their reason and source position, exactly once.

One ``_lua.APPEND`` call per chunk: its IDs are the deterministic IDs the records
would have had, so a producer that replays an epoch skips the prefix already there
and adds the rest."""

from __future__ import annotations

import hashlib
from typing import cast

from redis.asyncio import Redis

from ingest_service import _lua
from ingest_service._resp import call_packed_script
from ingest_service.metrics import IngestMetrics
from ingest_service.sources.planner import PlannedDeadLetter
from trainguard.core import streams

__all__ = ["append_dead_letters"]

_APPEND_SHA = hashlib.sha1(_lua.APPEND.encode()).hexdigest().encode()


async def append_dead_letters(redis: Redis, dataset: str, items: list[PlannedDeadLetter],
                              epoch: int, metrics: IngestMetrics) -> int:
    """Append the dead letters of ``items`` (planned in ``epoch``); returns how many
    were added (the others were already there)."""
    args: list[bytes] = [b""]
    for item in items:
        fields = streams.encode_dead_letter(
            item.record.reason, item.record.pos, item.record.payload,
            detail=item.record.detail, epoch=epoch,
        )
        args.append(streams.make_id(epoch, item.index).encode())
        args.append(b"%d" % len(fields))
        for k, v in fields.items():
            args.append(k)
            args.append(v)
    key = streams.dlq_key(dataset).encode()
    result = await call_packed_script(redis, _lua.APPEND, _APPEND_SHA, [key], args)
    added = int(cast(list[int], result)[0])
    # The script skips a prefix (entries already there) and adds the rest.
    for item in items[len(items) - added:]:
        metrics.dead_letters.labels(dataset=dataset, reason=item.record.reason).inc()
    return added
