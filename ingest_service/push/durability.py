"""Whether Redis keeps what the push route acknowledges, watched: :class:`DurabilityWatch`.

For pushed records Redis is the only copy, so an acknowledged push survives a Redis
restart only with an append-only file (or on a replica that ``WAIT`` confirmed). The
watch reads ``INFO`` at start and every ``interval_s``; a new ``run_id`` (Redis
restarted, or another server answers the URL) is a new server, whose persistence is
assessed again and whose contents are checked against what this service acknowledged
(:class:`~ingest_service.push.ledger.AckLedger`).

Our call on a Redis that would lose acknowledged pushes (no AOF, no replica): warn,
loudly, not refuse. Refusing would stop every demo and development setup (and a
service that only serves file datasets, which replay from their source), while a loss
is caught anyway by the ledger and reported by name. So: a WARNING in the log at
start and at every new server, ``durability`` in ``/readyz`` and
``GET /v1/push/durability`` says ``acknowledged_pushes_survive_restart: false`` and
why. Where the server has ``WAITAOF`` (Redis 7.2 on) and AOF but no replica, a push is
acknowledged only once the AOF has it on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiohttp import web
from redis.asyncio import Redis

from ingest_service import redis_client
from ingest_service.errors import PushDataLostError
from ingest_service.push.ingest import PushIngest, choose_partition
from ingest_service.push.ledger import ACKED_FIELD
from trainguard.core import streams

__all__ = ["DURABILITY_KEY", "DurabilityWatch", "assess", "setup_durability"]

log = logging.getLogger(__name__)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        parts.append(int(p) if p.isdigit() else 0)
    return tuple(parts)


def assess(info: dict[str, Any], wait_replicas: int | None) -> dict[str, object]:
    """What ``INFO`` (server, persistence, replication) says of acknowledged pushes."""
    aof = int(info.get("aof_enabled", 0)) == 1
    replicas = int(info.get("connected_slaves", 0))
    version = str(info.get("redis_version", "0"))
    replicated = wait_replicas != 0 and replicas > 0
    survives = aof or replicated
    if survives:
        why = ("an append-only file" if aof else "") + (" and " if aof and replicated else "") \
            + (f"{replicas} replica(s) confirming each push" if replicated else "")
        reason = f"Redis keeps acknowledged pushes: {why}"
    else:
        reason = ("Redis keeps no append-only file (appendonly no) and no replica confirms "
                  "pushes: a Redis restart loses acknowledged pushes (an RDB snapshot keeps "
                  "only what it held when saved; for pushed records Redis is the only "
                  "copy). Run Redis with --appendonly yes (docker-compose.yml does), or "
                  "with a replica")
    return {
        "acknowledged_pushes_survive_restart": survives, "reason": reason,
        "aof": aof, "replicas": replicas, "redis_version": version,
        "waitaof": aof and not replicated and _version(version) >= (7, 2),
    }


class DurabilityWatch:
    """Reads INFO every ``interval_s``; on a new server, assesses it and checks what it
    holds against the ledger."""

    def __init__(self, redis: Redis, ingest: PushIngest, *, interval_s: float = 1.0,
                 wait_aof: bool | None = None) -> None:
        self.redis, self.ingest, self.interval_s = redis, ingest, interval_s
        self.wait_aof = wait_aof
        self.run_id: str | None = None
        self.state: dict[str, object] = {"acknowledged_pushes_survive_restart": None,
                                         "reason": "not yet known: Redis not asked yet"}

    async def check(self) -> None:
        """One look; Redis errors propagate (the next look tries again)."""
        if redis_client.is_cluster(self.redis):
            # Each master has its replicas, whose WAIT the push route asks for.
            self.state = {"acknowledged_pushes_survive_restart": True,
                          "reason": "Redis Cluster: each push is confirmed by a replica"}
            await self.audit()
            return
        # The server section alone each look (INFO everything, whose parse held the loop
        # about 1 ms a second, was the service's longest periodic step); the sections
        # that say what survives a restart only for a new server.
        info = await self.redis.info("server")
        run_id = str(info.get("run_id", ""))
        if run_id == self.run_id:
            return
        for section in ("persistence", "replication"):
            info.update(await self.redis.info(section))
        first = self.run_id is None
        self.run_id = run_id
        self.state = assess(info, self.ingest.wait_replicas)
        wanted = self.wait_aof
        self.ingest.wait_aof = bool(self.state["waitaof"]) and wanted is not False
        self.state["waitaof"] = self.ingest.wait_aof
        if not self.state["acknowledged_pushes_survive_restart"]:
            log.warning("%s %s", "Redis at start:" if first else "Redis restarted:",
                        self.state["reason"])
        if not first:
            await self.audit()

    async def audit(self) -> None:
        """Every partition and producer the ledger remembers, against Redis now."""
        ledger = self.ingest.ledger
        read_at = ledger.tick()
        parts = ledger.partitions()
        datasets = sorted({d for d, _ in parts})
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in datasets:
                pipe.exists(streams.meta_key(d))
            for d, p in parts:
                pipe.hget(streams.seq_key(d, p), ACKED_FIELD)
            replies = await pipe.execute()
        present = dict(zip(datasets, replies[:len(datasets)], strict=True))
        for (d, p), found in zip(parts, replies[len(datasets):], strict=True):
            if present[d]:
                ledger.check_partition(d, p, int(found or 0), read_at)
        for d in datasets:
            if not present[d]:
                ledger.missing_dataset(d, read_at)
                continue
            spec = await self.ingest.spec(d)
            if spec is None:
                continue
            producers = ledger.producers(d)
            async with self.redis.pipeline(transaction=False) as pipe:
                for pid in producers:
                    pipe.hget(streams.seq_key(d, choose_partition(pid, spec.partitions)), pid)
                marks = await pipe.execute()
            for pid, mark in zip(producers, marks, strict=True):
                with contextlib.suppress(PushDataLostError):  # logged, kept for /readyz
                    ledger.check_mark(d, pid, None if mark is None else int(mark), read_at)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            try:
                await self.check()
            except redis_client.TRANSIENT:
                pass  # Redis away: the next look, once it is back, sees a new run_id
            except Exception:
                log.exception("the Redis durability check failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), self.interval_s)

    def report(self) -> dict[str, object]:
        """``durability`` and ``lost_acknowledged_data`` as /readyz shows them."""
        return {"durability": self.state,
                "lost_acknowledged_data": self.ingest.ledger.status()}


DURABILITY_KEY = web.AppKey("trainguard_ingest_durability", DurabilityWatch)


async def _show(request: web.Request) -> web.Response:
    return web.json_response(request.app[DURABILITY_KEY].report())


def setup_durability(app: web.Application, watch: DurabilityWatch) -> None:
    """``GET /v1/push/durability``: the watch's report (names and figures only)."""
    app[DURABILITY_KEY] = watch
    app.router.add_get("/v1/push/durability", _show)
