"""Lag when Redis cannot tell: after ``XGROUP SETID`` (every restore of a run moves its
group there) Redis forgets how many entries the group has read, and XINFO GROUPS
answers ``lag: nil`` until the group catches up. For a replayable dataset the IDs say
it anyway: record IDs are ``<epoch+1>-<index in the epoch>``, so the entries up to an
ID are the earlier epochs' counts plus ``index + 1``, and an epoch's count is its last
index + 1 (one XREVRANGE of one entry). Trims do not change the arithmetic.

Push datasets (IDs chosen by Redis) keep Redis' answer, null included.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from trainguard.core import streams
from trainguard.core.streams import ContractError

__all__ = ["MAX_EPOCHS_SPANNED", "fill_lag"]

MAX_EPOCHS_SPANNED = 16
"""Beyond this many epochs between the group and the producer, the lag stays null
(one Redis call per epoch)."""


async def _epoch_count(r: aioredis.Redis, key: str, epoch: int) -> int:
    last: list[Any] = await r.xrevrange(key, max=f"{epoch + 1}-{2**64 - 1}",
                                        min=f"{epoch + 1}-0", count=1) or []
    return streams.id_epoch_index(last[0][0])[1] + 1 if last else 0


async def _entries_upto(r: aioredis.Redis, key: str, stream_id: str, first_epoch: int) -> int:
    """Entries with IDs in (first_epoch-0, stream_id] by the ID arithmetic."""
    if stream_id == streams.ZERO_ID:
        return 0
    epoch, index = streams.id_epoch_index(stream_id)
    total = index + 1
    for e in range(first_epoch, epoch):
        total += await _epoch_count(r, key, e)
    return total


async def fill_lag(r: aioredis.Redis, spec: streams.DatasetSpec,
                   partitions: list[dict[str, Any]], last_ids: dict[int, str | None]) -> None:
    """Set ``lag`` (and ``lag_from``: "redis" or "ids") on each group partition row of
    ``partitions`` (rows of :func:`ingest_service.inspection.dataset_groups`), given
    each partition's last generated ID."""
    for row in partitions:
        row["lag_from"] = "redis" if row["lag"] is not None else None
        delivered, last = row["last_delivered_id"], last_ids.get(row["partition"])
        if row["lag"] is not None or not spec.replayable or delivered is None:
            continue
        if last in (None, streams.ZERO_ID):
            row["lag"], row["lag_from"] = 0, "ids"
            continue
        try:
            start = 0 if delivered == streams.ZERO_ID else streams.id_epoch_index(delivered)[0]
            if streams.id_epoch_index(last)[0] - start > MAX_EPOCHS_SPANNED:
                continue
            key = streams.partition_key(spec.name, row["partition"])
            lag = (await _entries_upto(r, key, last, start)
                   - await _entries_upto(r, key, delivered, start))
        except ContractError:
            continue  # not a deterministic ID after all
        row["lag"], row["lag_from"] = max(0, lag), "ids"
