"""The service's periodic work keeps the event loop's steps small, against a real Redis.

Properties (structure only, no time measured; before, these were the loop's longest
steps with no request at all, 1-4 ms each, beside which a bomb's steps were judged):
- a throughput sample of a push dataset whose partitions no record reached yet leaves
  nothing for the cyclic garbage collector (each missing stream's error reply held its
  pipeline's frames in a cycle, freed only by a gen-1 pass);
- the durability watch asks Redis for the server section alone while the same server
  answers, and reads persistence and replication again only for a new one.
"""

from __future__ import annotations

import gc
from typing import Any

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
from ingest_service.push.durability import DurabilityWatch
from ingest_service.push.ingest import PushIngest
from ingest_service.service.throughput import ThroughputSampler
from tests.servers import RedisServer
from trainguard.core import streams


async def test_a_sample_of_partitions_with_no_stream_yet_leaves_no_cyclic_garbage(
        redis_server: RedisServer) -> None:
    """Eight samples of a 16-partition push dataset nobody pushed to: the collector,
    kept off meanwhile, then finds nothing unreachable; the sample counts 0 produced."""
    r = Redis.from_url(redis_server.url)
    await create_dataset(r, streams.DatasetSpec(name="quiet", partitions=16, format="push"))
    sampler = ThroughputSampler(CollectorRegistry(), interval_s=0.01)
    await sampler.sample(r)  # the first call's imports and caches are not the property
    gc.collect()
    gc.disable()
    try:
        for _ in range(8):
            await sampler.sample(r)
        found = gc.collect()
    finally:
        gc.enable()
    await r.aclose()
    assert found == 0
    assert sampler._rings["quiet"][-1].produced == 0


class _Recorded(Redis):  # type: ignore[misc]
    """The real client, each INFO call's sections recorded."""

    sections: list[tuple[Any, ...]]

    async def info(self, section: Any = None, *args: Any, **kwargs: Any) -> Any:
        self.sections.append((section, *args))
        return await super().info(section, *args, **kwargs)


async def test_the_durability_watch_reads_the_server_section_alone_while_the_server_stays(
        redis_server: RedisServer) -> None:
    """Three looks at the same server: the first reads server, persistence and
    replication (and says, of this Redis without AOF or replica, that acknowledged pushes
    would not survive a restart); the next two read the server section only."""
    r = _Recorded(host="127.0.0.1", port=redis_server.port)
    r.sections = []
    watch = DurabilityWatch(r, PushIngest(r, BacklogLimits(), wait_replicas=0))
    await watch.check()
    first = list(r.sections)
    await watch.check()
    await watch.check()
    await r.aclose()
    assert first == [("server",), ("persistence",), ("replication",)]
    assert r.sections[len(first):] == [("server",), ("server",)]
    assert watch.state["acknowledged_pushes_survive_restart"] is False
