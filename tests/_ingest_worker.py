"""Subprocess of the kill -9 tests: runs one Producer to completion, then exits 0.

Usage: python tests/_ingest_worker.py REDIS_URL SPEC_JSON [BATCH_RECORDS]
"""

from __future__ import annotations

import asyncio
import json
import sys

from ingest_service import redis_client
from ingest_service.producer.producer import Producer
from trainguard.core import streams


async def main(url: str, spec_json: str, batch_records: int) -> None:
    spec = streams.DatasetSpec(**json.loads(spec_json))
    client = redis_client.client(url)
    try:
        # Short leases: a restarted worker takes over its killed predecessor's
        # partitions within 300 ms.
        await Producer(client, spec, batch_records=batch_records, lease_ms=300).run()
    finally:
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 512))
