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

With ``--cluster`` each round also runs both on a Redis Cluster (3 masters, 3
replicas, started here): raw is then one ``redis-cli --pipe`` per master, fed that
master's partitions, all at once; and the producer's throughput on the cluster is
compared with single Redis, round by round.
Usage: python bench/ingest.py [--mb 256] [--partitions 16] [--rounds 3] [--cluster]
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

from ingest_service import redis_client  # noqa: E402
from ingest_service.producer import Producer  # noqa: E402
from tests.servers import RedisCluster, RedisServer  # noqa: E402
from trainguard.core import streams  # noqa: E402

SIZES = (100, 8 * 1024, 128 * 1024)


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


Target = tuple[str, RedisServer | RedisCluster]


def masters(target: RedisServer | RedisCluster, partitions: int) -> dict[int, int]:
    """The port of the server that holds each raw partition."""
    if isinstance(target, RedisServer):
        return dict.fromkeys(range(partitions), target.port)
    return {p: target.master_of(streams.partition_key("raw", p)).port for p in range(partitions)}


def write_raw_commands(folder: Path, count: int, size: int, where: dict[int, int]) -> dict[int, Path]:
    """One command file per server (port), each with the XADDs of its partitions."""
    payload = b"x" * size
    paths = {port: folder / f"raw-{size}-{port}.resp" for port in set(where.values())}
    outs = {port: open(path, "wb") for port, path in paths.items()}  # noqa: SIM115
    try:
        for i in range(count):
            p = i % len(where)
            key = streams.partition_key("raw", p).encode()
            rid = streams.make_id(0, i // len(where)).encode()
            outs[where[p]].write(b"*5\r\n" + _bulk(b"XADD") + _bulk(key) + _bulk(rid)
                                 + _bulk(b"d") + _bulk(payload))
    finally:
        for out in outs.values():
            out.close()
    return paths


def run_raw(files: dict[int, Path]) -> float:
    """Every server's ``redis-cli --pipe`` at once; seconds until the last is done."""
    start = time.perf_counter()
    procs = []
    for port, path in files.items():
        with open(path, "rb") as f:
            procs.append(subprocess.Popen(["redis-cli", "-p", str(port), "--pipe"], stdin=f,
                                          stdout=subprocess.PIPE, text=True))
    outs = [proc.communicate()[0] for proc in procs]
    elapsed = time.perf_counter() - start
    for out in outs:
        if "errors: 0" not in out:
            raise RuntimeError(f"redis-cli --pipe reported errors: {out}")
    return elapsed


def flushall(target: RedisServer | RedisCluster) -> None:
    if isinstance(target, RedisCluster):
        target.flushall()
        return
    client = redis.Redis(port=target.port)
    client.flushall()
    client.close()


async def run_trainguard(
    url: str, source: Path, size: int, partitions: int
) -> tuple[float, float, int]:
    client = redis_client.client(url)
    spec = streams.DatasetSpec(name=f"tg{size}", partitions=partitions, source=str(source),
                               format="npy", sample_len=size, shuffle_buffer=1024)
    producer = Producer(client, spec)
    cpu = time.process_time()
    start = time.perf_counter()
    await producer.run()
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    await client.aclose()
    return elapsed, cpu, producer.progress.records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="payload MB per record size")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cluster", action="store_true",
                        help="also on a Redis Cluster (3 masters + 3 replicas)")
    args = parser.parse_args()
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: install redis-tools / redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ingest-"))
    targets: list[Target] = [("single", RedisServer(tmp / "redis").start())]
    if args.cluster:
        targets.append(("cluster", RedisCluster(tmp / "cluster").start()))
    try:
        print(f"{args.partitions} partitions, {args.mb} MB of payload per size, best of "
              f"{args.rounds} rounds; {', '.join(name for name, _ in targets)} in each round")
        print(f"{'redis':>7} {'size':>8} {'records':>9} | {'raw rec/s':>11} {'raw MB/s':>9} | "
              f"{'tg rec/s':>11} {'tg MB/s':>9} | {'ratio':>5} | {'paired ratios':>16} | "
              f"{'tg MB/cpu-s':>11}")
        for size in SIZES:
            count = max(1000, args.mb * 1_000_000 // size)
            source = tmp / f"tokens-{size}.npy"
            np.save(source, np.full(count * size, ord("x"), dtype=np.uint8))
            files = {name: write_raw_commands(tmp, count, size, masters(t, args.partitions))
                     for name, t in targets}
            raw_s: dict[str, list[float]] = {name: [] for name, _ in targets}
            tg_s: dict[str, list[float]] = {name: [] for name, _ in targets}
            tg_cpu: dict[str, list[float]] = {name: [] for name, _ in targets}
            for _ in range(args.rounds):
                for name, target in targets:  # interleaved: each round runs every target
                    raw_s[name].append(run_raw(files[name]))
                    flushall(target)
                    elapsed, cpu, records = asyncio.run(
                        run_trainguard(target.url, source, size, args.partitions)
                    )
                    flushall(target)
                    if records != count:
                        raise RuntimeError(f"producer appended {records} records, expected {count}")
                    tg_s[name].append(elapsed)
                    tg_cpu[name].append(cpu)
            for paths in files.values():
                for path in paths.values():
                    path.unlink()
            source.unlink()
            mb = count * size / 1e6
            for name, _ in targets:
                ratios = sorted(r / t for r, t in zip(raw_s[name], tg_s[name]))
                raw, tg = min(raw_s[name]), min(tg_s[name])
                paired = f"{statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
                print(f"{name:>7} {size:>8} {count:>9} | {count / raw:>11,.0f} {mb / raw:>9,.1f} | "
                      f"{count / tg:>11,.0f} {mb / tg:>9,.1f} | {raw / tg:>5.2f} | {paired:>16} | "
                      f"{mb / min(tg_cpu[name]):>11,.1f}")
            if args.cluster:
                pairs = sorted(s / c for s, c in zip(tg_s["single"], tg_s["cluster"]))
                print(f"{'':>7} {size:>8} producer on the cluster / on single Redis, paired rounds: "
                      f"{statistics.median(pairs):.2f} ({pairs[0]:.2f}-{pairs[-1]:.2f})")
    finally:
        for _, target in targets:
            if isinstance(target, RedisCluster):
                target.stop()
            else:
                target.kill()
        shutil.rmtree(tmp, ignore_errors=True)

if __name__ == "__main__":
    main()
