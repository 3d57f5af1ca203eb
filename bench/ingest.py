"""Ingest benchmark: the trainguard producer against Redis' own XADD limit.

In one run against one fresh redis-server (started here on a free port, no
persistence), for records of 100 B, 8 KiB and 128 KiB:

1. raw: ``redis-cli --pipe`` fed pre-encoded ``XADD <partition> <id> d <payload>``
   commands, spread over the same partitions: what Redis itself takes;
2. trainguard: the Producer from a file source (a uint8 ``.npy`` cut into records of
   that size), shuffle, deterministic IDs, exactly-once Lua appends.

Prints records/s, MB/s (payload bytes) and trainguard/raw, plus the producer's MB per
CPU-second of its own process (what one free core would give it; this number depends
less on what else the machine runs). Not a test: numbers vary.
Usage: python bench/ingest.py [--mb 64] [--partitions 16]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from ingest_service.producer import Producer  # noqa: E402
from tests.servers import RedisServer  # noqa: E402
from trainguard import streams  # noqa: E402

SIZES = (100, 8 * 1024, 128 * 1024)


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


def write_raw_commands(path: Path, count: int, size: int, partitions: int) -> None:
    payload = b"x" * size
    with open(path, "wb") as out:
        for i in range(count):
            key = streams.partition_key("raw", i % partitions).encode()
            rid = streams.make_id(0, i // partitions).encode()
            out.write(b"*5\r\n" + _bulk(b"XADD") + _bulk(key) + _bulk(rid) + _bulk(b"d")
                      + _bulk(payload))


def run_raw(server: RedisServer, path: Path) -> float:
    start = time.perf_counter()
    with open(path, "rb") as f:
        done = subprocess.run(["redis-cli", "-p", str(server.port), "--pipe"], stdin=f,
                              capture_output=True, text=True, check=True)
    elapsed = time.perf_counter() - start
    if "errors: 0" not in done.stdout:
        raise RuntimeError(f"redis-cli --pipe reported errors: {done.stdout}")
    return elapsed


async def run_trainguard(
    url: str, source: Path, size: int, partitions: int
) -> tuple[float, float, int]:
    client = Redis.from_url(url)
    spec = streams.DatasetSpec(name=f"tg{size}", partitions=partitions, source=str(source),
                               format="npy", sample_len=size, shuffle_buffer=1024)
    producer = Producer(client, spec)
    cpu = time.process_time()
    start = time.perf_counter()
    await producer.run()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    await client.flushall()
    await client.aclose()
    return elapsed, cpu, producer.progress.records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="payload MB per record size")
    parser.add_argument("--partitions", type=int, default=16)
    args = parser.parse_args()
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: install redis-tools / redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ingest-"))
    server = RedisServer(tmp / "redis").start()
    try:
        print(f"redis-server :{server.port}, {args.partitions} partitions, "
              f"{args.mb} MB of payload per size")
        print(f"{'size':>8} {'records':>9} | {'raw rec/s':>11} {'raw MB/s':>9} | "
              f"{'tg rec/s':>11} {'tg MB/s':>9} | {'ratio':>5} | {'tg MB/cpu-s':>11}")
        for size in SIZES:
            count = max(1000, args.mb * 1_000_000 // size)
            cmds = tmp / f"raw-{size}.resp"
            write_raw_commands(cmds, count, size, args.partitions)
            raw_s = run_raw(server, cmds)
            cmds.unlink()
            import redis

            redis.Redis(port=server.port).flushall()
            source = tmp / f"tokens-{size}.npy"
            np.save(source, np.full(count * size, ord("x"), dtype=np.uint8))
            tg_s, tg_cpu, records = asyncio.run(
                run_trainguard(server.url, source, size, args.partitions)
            )
            source.unlink()
            if records != count:
                raise RuntimeError(f"producer appended {records} records, expected {count}")
            mb = count * size / 1e6
            print(f"{size:>8} {count:>9} | {count / raw_s:>11,.0f} {mb / raw_s:>9,.1f} | "
                  f"{count / tg_s:>11,.0f} {mb / tg_s:>9,.1f} | {raw_s / tg_s:>5.2f} | "
                  f"{mb / tg_cpu:>11,.1f}")
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
