"""The push service's memory under a burst of big bodies, measured on a real
``trainguard serve`` process (its ``VmHWM`` in ``/proc/<pid>/status``) against a real
Redis.

Property: 300 clients pushing a 1 MiB msgpack body each, all at once, raise the
service's peak RSS by less than a bound derived from its configuration: twice the
body budget (``max_inflight_bytes``: a body held while its records, about as large,
are parsed and sent) plus what aiohttp buffers of each waiting connection (twice
``READ_BUFSIZE``) plus 24 MiB for the rest. And the burst loses nothing: every
answer is 200 or 503 (busy, retry), and the records of every 200 are in the dataset
exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgpack
import pytest
from redis import Redis

from ingest_service.push.body import BodyLimits
from ingest_service.service.app import READ_BUFSIZE
from tests.servers import RedisServer, free_port
from trainguard.core import streams

ROOT = Path(__file__).resolve().parent.parent
TOKENS = [f"memory-token-{i}-0123456789" for i in range(4)]
"""Four producer tokens: together their shares can hold the whole body budget."""
CLIENTS, RECORDS, RECORD_BYTES = 300, 63, 16 * 1024
MIB = 1024 * 1024


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def _wait_ready(session: aiohttp.ClientSession, base: str,
                      service: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        assert service.poll() is None, "the service exited before it was ready"
        try:
            async with session.get(f"{base}/readyz") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("the service was not ready within 60 s")


@pytest.mark.slow
def test_a_burst_of_300_one_mib_pushes_stays_within_the_body_budget(
        redis_factory: Callable[..., RedisServer]) -> None:
    """300 concurrent 1 MiB pushes raise the service's peak RSS by less than
    2 x max_inflight_bytes + 300 x 2 x READ_BUFSIZE + 24 MiB, and every batch answered
    200 is in the dataset once (the others were answered 503)."""
    server = redis_factory()

    async def create() -> None:
        from redis.asyncio import Redis as AsyncRedis

        from ingest_service.datasets import create_dataset

        client = AsyncRedis.from_url(server.url)
        await create_dataset(client, streams.DatasetSpec(name="rl", partitions=64, format="push"))
        await client.aclose()

    asyncio.run(create())
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": ";".join(f"{t}:rl:w{i}-*" for i, t in enumerate(TOKENS))}
    service = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                                "--no-produce"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    bodies = [msgpack.packb([os.urandom(RECORD_BYTES) for _ in range(RECORDS)])
              for _ in range(CLIENTS)]
    assert all(MIB * 0.95 < len(b) <= MIB for b in bodies)

    async def push(session: aiohttp.ClientSession, token: int, name: str, body: bytes) -> int:
        async with session.post(
                f"{base}/v1/datasets/rl/records?producer_id={name}&seq=0", data=body,
                headers={"Content-Type": "application/msgpack",
                         "Authorization": f"Bearer {TOKENS[token]}"}) as resp:
            await resp.read()
            return resp.status

    async def burst() -> tuple[int, collections.Counter[int], dict[str, int]]:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=300)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await _wait_ready(session, base, service)
            for seq in range(3):  # warm: every code path of a big push has run once
                async with session.post(
                        f"{base}/v1/datasets/rl/records?producer_id=w0-warm&seq={seq}",
                        data=bodies[0], headers={"Content-Type": "application/msgpack",
                                                 "Authorization": f"Bearer {TOKENS[0]}"}) as resp:
                    assert resp.status == 200, await resp.text()
            # The peak from here on: clear_refs 5 resets VmHWM to the RSS now.
            Path(f"/proc/{service.pid}/clear_refs").write_text("5")
            before = _status_kb(service.pid, "VmHWM")
            names = [f"w{i % len(TOKENS)}-{i}" for i in range(CLIENTS)]
            statuses = await asyncio.gather(*[
                push(session, i % len(TOKENS), names[i], bodies[i]) for i in range(CLIENTS)])
            growth = _status_kb(service.pid, "VmHWM") - before
        return growth, collections.Counter(statuses), dict(zip(names, statuses, strict=True))

    try:
        growth_kb, counts, by_name = asyncio.run(burst())
    finally:
        service.terminate()
        service.wait(60)
    limits = BodyLimits()
    bound = 2 * limits.max_inflight_bytes + CLIENTS * 2 * READ_BUFSIZE + 24 * MIB
    print(f"statuses {dict(counts)}, peak RSS growth {growth_kb / 1024:.0f} MiB, "
          f"bound {bound / MIB:.0f} MiB")
    assert set(counts) <= {200, 503}, counts
    assert counts[200] > 0
    assert growth_kb * 1024 < bound, (growth_kb / 1024, bound / MIB)
    # Nothing lost, nothing twice: each 200's 63 records are in its producer's partition.
    r = Redis.from_url(server.url)
    try:
        seen: collections.Counter[bytes] = collections.Counter()
        for p in range(64):
            for _, fields in r.xrange(streams.partition_key("rl", p)):
                seen[fields[streams.F_DATA]] += 1
    finally:
        r.close()
    expected = collections.Counter(
        record for i, name in enumerate(by_name) if by_name[name] == 200
        for record in msgpack.unpackb(bodies[i]))
    expected.update(msgpack.unpackb(bodies[0]) * 3)  # the warm-up pushes
    assert seen == expected


def test_a_big_json_array_body_is_not_copied_whole_while_parsed() -> None:
    """Property: parsing a JSON array body over 1 MiB (3 MB of records whose strings
    are all escapes, six bytes of JSON per character) allocates less than three quarters
    of the body's size at its peak (the records' entries, a sixth of it, their dicts,
    one record's text, the loop's own), not a str copy of the whole body besides (1.3
    times the body's size before). Every record
    comes out whole, in order. Measured with tracemalloc: allocations, not time."""
    import json
    import tracemalloc

    from ingest_service.push.body import parse_records_sliced

    records = [f"{i:06d}" + "\\u0041" * 1000 for i in range(500)]
    body = bytearray(("[" + ",".join(f'"{r}"' for r in records) + "]").encode())
    assert len(body) > 2 * 2**20  # over the 1 MiB from which records are scanned
    tracemalloc.start()
    try:
        batch = asyncio.run(parse_records_sliced(body, "application/json", 16 * 2**20,
                                                 BodyLimits()))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(body) * 3 / 4, f"peak {peak} bytes for a body of {len(body)}"
    assert [streams.decode_record(f) for f in batch.records] == [
        json.loads(f'"{r}"') for r in records]
