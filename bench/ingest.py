"""Ingest benchmark: the trainguard producer against Redis' own XADD limit.

In one run against one fresh redis-server (started here on a free port, no
persistence), for records of 100 B, 8 KiB and 128 KiB:

1. raw: ``redis-cli --pipe`` fed pre-encoded ``XADD <partition> <id> d <payload>``
   commands, spread over the same partitions: what Redis itself takes;
2. trainguard: the Producer from a file source (a uint8 ``.npy`` cut into records of
   that size), shuffle, deterministic IDs, pipelined XADDs with explicit IDs.

Each size runs ``--rounds`` rounds of raw then trainguard back to back. The table shows
the best round of each (records/s, MB/s of payload bytes) and their ratio, the median
and range of the ratio of each round's pair (a pair shares the machine's mood), and the
producer's MB per CPU-second of its own process (what one free core would give it).
Runs are a few hundred MB, so that start-up (connections, the first sync) is noise.
Not a test: on a shared 2-core machine raw alone moves by 2x between rounds.
Usage: python bench/ingest.py [--mb 256] [--partitions 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from ingest_service.producer import Producer  # noqa: E402
from tests.servers import RedisServer  # noqa: E402
from trainguard.core import streams  # noqa: E402

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
    parser.add_argument("--mb", type=int, default=256, help="payload MB per record size")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: install redis-tools / redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ingest-"))
    server = RedisServer(tmp / "redis").start()
    flush = redis.Redis(port=server.port)
    try:
        print(f"redis-server :{server.port}, {args.partitions} partitions, "
              f"{args.mb} MB of payload per size, best of {args.rounds} rounds")
        print(f"{'size':>8} {'records':>9} | {'raw rec/s':>11} {'raw MB/s':>9} | "
              f"{'tg rec/s':>11} {'tg MB/s':>9} | {'ratio':>5} | {'paired ratios':>16} | "
              f"{'tg MB/cpu-s':>11}")
        for size in SIZES:
            count = max(1000, args.mb * 1_000_000 // size)
            cmds = tmp / f"raw-{size}.resp"
            write_raw_commands(cmds, count, size, args.partitions)
            source = tmp / f"tokens-{size}.npy"
            np.save(source, np.full(count * size, ord("x"), dtype=np.uint8))
            raw_s: list[float] = []
            tg_s: list[float] = []
            tg_cpu: list[float] = []
            for _ in range(args.rounds):
                raw_s.append(run_raw(server, cmds))
                flush.flushall()
                elapsed, cpu, records = asyncio.run(
                    run_trainguard(server.url, source, size, args.partitions)
                )
                if records != count:
                    raise RuntimeError(f"producer appended {records} records, expected {count}")
                tg_s.append(elapsed)
                tg_cpu.append(cpu)
            cmds.unlink()
            source.unlink()
            mb = count * size / 1e6
            ratios = sorted(r / t for r, t in zip(raw_s, tg_s))
            raw, tg = min(raw_s), min(tg_s)
            paired = f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
            print(f"{size:>8} {count:>9} | {count / raw:>11,.0f} {mb / raw:>9,.1f} | "
                  f"{count / tg:>11,.0f} {mb / tg:>9,.1f} | {raw / tg:>5.2f} | {paired:>16} | "
                  f"{mb / min(tg_cpu):>11,.1f}")
    finally:
        flush.close()
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
