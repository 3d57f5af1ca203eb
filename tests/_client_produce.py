"""Test helper: the real ingest producer as a subprocess (killed with SIGKILL by tests).

``python tests/_client_produce.py URL DATASET SOURCE PARTITIONS MAX_BACKLOG`` creates
(or re-checks) an ``npy`` dataset of 8-token records over SOURCE and produces it with a
small backlog bound, so that it keeps pausing until the trainer commits; prints
``PRODUCED`` when the dataset is complete.
"""

from __future__ import annotations

import asyncio
import sys

from redis.asyncio import Redis

from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
from ingest_service.producer import Producer
from trainguard.core import streams


async def main(url: str, name: str, source: str, partitions: int, max_backlog: int) -> None:
    client = Redis.from_url(url)
    spec = streams.DatasetSpec(
        name=name, partitions=partitions, source=source, format="npy", sample_len=8, epochs=1,
        seed=3,
    )
    spec = await create_dataset(client, spec)
    await Producer(client, spec, limits=BacklogLimits(max_entries=max_backlog, poll_interval_s=0.02),
                   maintenance_interval_s=0.2).run()
    print("PRODUCED", flush=True)
    await client.aclose()


if __name__ == "__main__":
    url, name, source, partitions, backlog = sys.argv[1:6]
    asyncio.run(main(url, name, source, int(partitions), int(backlog)))
