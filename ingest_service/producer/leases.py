"""Partition leases: how several file producers share one dataset's partitions.

Every producer of a dataset (``trainguard ingest`` or ``serve`` processes, any number)
runs rounds, every third of ``lease_ms``:

1. Heartbeat: it writes its owner id with an expiry into the dataset's producer
   registry (``streams.producers_key``) and reads the live ones back, expired ones
   dropped (all in Redis time, one Lua call).
2. Its share: the live producers in sorted order; producer ``i`` of ``n`` wants the
   partitions ``p % n == i``.
3. Per partition, in the partition's own slot (one Lua call each, pipelined per
   master): renew or take the lease it wants (``SET PX`` when the key is free or
   already its own), release the ones it holds but no longer wants.

A killed producer stops renewing: its heartbeat and leases expire after ``lease_ms``
and the others' next round takes its partitions. A producer that joins takes its share
once the holders released it (their next round). Leases save work, they do not carry
exactly-once: two producers writing one partition for a moment (a release and a take
over in flight) append the same records under the same deterministic IDs, and Redis
refuses the second copy of each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis

from ingest_service import redis_client
from trainguard.core import streams

__all__ = ["LEASE_MS", "PartitionLeases", "new_owner_id", "share"]

log = logging.getLogger(__name__)

LEASE_MS = 5000
"""How long a producer's leases outlive its last renewal: a killed producer's partitions
are taken over within this time (plus a round)."""

_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] ~= '0' then redis.call('HSET', KEYS[1], ARGV[1], now + tonumber(ARGV[2])) end
local all = redis.call('HGETALL', KEYS[1])
local live = {}
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) > now then live[#live + 1] = all[i]
  else redis.call('HDEL', KEYS[1], all[i]) end
end
return live
"""
"""KEYS[1] the producer registry; ARGV owner, ttl_ms (0: only read). Returns the live
owners (the caller included, when it wrote)."""

_LEASE = """
local cur = redis.call('GET', KEYS[1])
if ARGV[3] == '1' then
  if cur == false or cur == ARGV[1] then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 1
  end
  return 0
end
if cur == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""
"""KEYS[1] a partition's lease; ARGV owner, ttl_ms, want (1: take or renew, 0:
release). Returns 1 when the caller holds the lease after the call."""


def new_owner_id() -> str:
    """Unique per producer object: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def share(owner: str, live: list[str], partitions: int) -> frozenset[int]:
    """The partitions ``owner`` wants among ``live`` producers (it counts itself)."""
    ring = sorted({*live, owner})
    i, n = ring.index(owner), len(ring)
    return frozenset(p for p in range(partitions) if p % n == i)


class PartitionLeases:
    """One producer's leases on one dataset. ``owned`` is what it may write now;
    ``changed`` is set whenever ``owned`` changes (the producer clears it when it
    re-plans)."""

    def __init__(self, redis: Redis, dataset: str, partitions: int, *,
                 owner: str | None = None, lease_ms: int = LEASE_MS) -> None:
        if lease_ms < 30:
            raise ValueError(f"lease_ms is {lease_ms}: expected at least 30 ms")
        self.redis = redis
        self.dataset = dataset
        self.partitions = partitions
        self.owner = owner or new_owner_id()
        self.lease_ms = lease_ms
        self.owned: frozenset[int] = frozenset()
        self.changed = asyncio.Event()
        self.on_change: Callable[[], None] | None = None
        """Called whenever ``owned`` changes (the producer halts its epoch)."""
        self._keys = [streams.lease_key(dataset, p) for p in range(partitions)]

    @property
    def interval_s(self) -> float:
        return self.lease_ms / 3000

    async def live(self, *, heartbeat: bool = False) -> list[str]:
        """The live producers of the dataset (with ``heartbeat``, after announcing this
        one for another ``lease_ms``)."""
        raw: Any = await self.redis.execute_command(
            "EVAL", _HEARTBEAT, 1, streams.producers_key(self.dataset), self.owner,
            self.lease_ms if heartbeat else 0)
        return [x.decode() if isinstance(x, bytes) else str(x) for x in raw]

    async def round(self) -> frozenset[int]:
        """One heartbeat and one pass over the partitions; returns ``owned``."""
        wanted = share(self.owner, await self.live(heartbeat=True), self.partitions)
        held = await self._apply({p: p in wanted for p in range(self.partitions)})
        self._set(frozenset(p for p, ok in held.items() if ok))
        return self.owned

    async def release(self) -> None:
        """Give every lease and the heartbeat back (a clean stop: the others take over
        at once instead of after ``lease_ms``)."""
        with contextlib.suppress(*redis_client.TRANSIENT):
            await self._apply(dict.fromkeys(range(self.partitions), False))
            await self.redis.hdel(streams.producers_key(self.dataset), self.owner)
        self._set(frozenset())

    async def run(self, stop: asyncio.Event) -> None:
        """A round every ``interval_s`` until ``stop`` (the first after one interval:
        the caller ran one). A failed round (Redis out of reach) changes nothing here;
        the leases themselves expire if it lasts."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            if stop.is_set():
                return
            try:
                await self.round()
            except redis_client.TRANSIENT as exc:
                log.debug("dataset %s: lease round failed: %s", self.dataset, exc)

    async def _apply(self, want: dict[int, bool]) -> dict[int, bool]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for p, take in want.items():
                pipe.execute_command("EVAL", _LEASE, 1, self._keys[p], self.owner,
                                     self.lease_ms, "1" if take else "0")
            replies = await pipe.execute()
        return {p: int(r) == 1 for p, r in zip(want, replies, strict=True)}

    def _set(self, owned: frozenset[int]) -> None:
        if owned != self.owned:
            log.info("dataset %s: producer %s writes partitions %s", self.dataset, self.owner,
                     sorted(owned))
            self.owned = owned
            self.changed.set()
            if self.on_change is not None:
                self.on_change()
