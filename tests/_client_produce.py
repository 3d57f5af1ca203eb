"""Test helper: the real ingest producer as a subprocess (killed with SIGKILL by tests).

``python tests/_client_produce.py URL DATASET SOURCE PARTITIONS MAX_BACKLOG [LEASE_MS]``
creates (or re-checks) an ``npy`` dataset of 8-token records over SOURCE and produces
it with a small backlog bound, so that it keeps pausing until the trainer commits;
prints ``PRODUCED`` when the dataset is complete. Several of them share the dataset's
partitions through leases (``LEASE_MS``); each logs the partitions it writes.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from ingest_service import redis_client
from ingest_service.backlog import BacklogLimits
from ingest_service.datasets import create_dataset
from ingest_service.producer.producer import Producer
from trainguard.core import streams


async def main(url: str, name: str, source: str, partitions: int, max_backlog: int,
               lease_ms: int) -> None:
    client = redis_client.client(url)
    spec = streams.DatasetSpec(
        name=name, partitions=partitions, source=source, format="npy", sample_len=8, epochs=1,
        seed=3,
    )
    spec = await create_dataset(client, spec)
    await Producer(client, spec, limits=BacklogLimits(max_entries=max_backlog, poll_interval_s=0.02),
                   maintenance_interval_s=0.2, lease_ms=lease_ms).run()
    print("PRODUCED", flush=True)
    await client.aclose()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    url, name, source, partitions, backlog = sys.argv[1:6]
    lease = int(sys.argv[6]) if len(sys.argv) > 6 else 5000
    asyncio.run(main(url, name, source, int(partitions), int(backlog), lease))
