"""Subprocess of the kill -9 tests: runs one Producer to completion, then exits 0.

Usage: python tests/_ingest_worker.py REDIS_URL SPEC_JSON [BATCH_RECORDS]
"""

from __future__ import annotations

import asyncio
import json
import sys

from redis.asyncio import Redis

from ingest_service.producer import Producer
from trainguard.core import streams


async def main(url: str, spec_json: str, batch_records: int) -> None:
    spec = streams.DatasetSpec(**json.loads(spec_json))
    client = Redis.from_url(url)
    try:
        await Producer(client, spec, batch_records=batch_records).run()
    finally:
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 512))
