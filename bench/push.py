"""Push benchmark: HTTP push through ``trainguard serve`` against raw pipelined XADD.

In one run, against one fresh redis-server and one ``trainguard serve`` process (both
started here on free ports; the service with a producer token, no file producers):

1. Closed loop, ``--rounds`` rounds of service then raw back to back (paired, ABAB):
   ``--producers`` concurrent producers each send ``--batches`` batches of
   ``--records`` records of ``--record-bytes`` bytes; through the service (msgpack
   bodies, one producer_id each, seqs 0, 1, ...) and as raw pipelined XADDs of the
   same encoded entries to the same partitions (one pipeline per batch). Prints the
   batches/s of each, the median and range of the per-round ratio, and p50/p99 batch
   latency over all rounds.
2. Open loop at half the service's measured saturation rate: each producer sends on a
   fixed schedule; latency counts from the scheduled time (no coordinated omission).
3. The same open loop while one more client sends the worst-case push in a loop: a
   body at the byte limit of records that all parse, the last one over the dataset's
   record limit, so every one is read, parsed and refused (413).

The service's RSS is read from /proc before and after each phase. Not a test: on a
shared 2-core machine the load generator, the service and Redis share the cores.
Usage: python bench/push.py [--rounds 4] [--producers 32] [--batches 20] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402

from ingest_service.datasets import create_dataset  # noqa: E402
from ingest_service.push import choose_partition  # noqa: E402
from tests.servers import RedisServer, free_port  # noqa: E402
from trainguard.core import streams  # noqa: E402

TOKEN = "bench-producer-token-0123456789"
DATASET, PARTITIONS = "rollouts", 16


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


class Bench:
    def __init__(self, args: argparse.Namespace, redis_url: str, base: str) -> None:
        self.args, self.redis_url, self.base = args, redis_url, base
        self.payload = os.urandom(args.record_bytes)
        self.body = msgpack.packb([self.payload] * args.records, use_bin_type=True)
        self.fields = streams.encode_record(self.payload)
        self.seqs: dict[str, int] = {}
        self.generation = 0

    def producer_ids(self) -> list[str]:
        return [f"actor-{self.generation}-{i}" for i in range(self.args.producers)]

    async def push(self, session: aiohttp.ClientSession, producer: str) -> float:
        seq = self.seqs.get(producer, 0)
        start = time.perf_counter()
        async with session.post(f"{self.base}/v1/datasets/{DATASET}/records",
                                params={"producer_id": producer, "seq": str(seq)},
                                data=self.body, headers={
                                    "Authorization": f"Bearer {TOKEN}",
                                    "Content-Type": "application/msgpack"}) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"push answered {resp.status}: {await resp.text()}")
        self.seqs[producer] = seq + 1
        return time.perf_counter() - start

    async def raw(self, r: Redis, producer: str) -> float:
        key = streams.partition_key("raw", choose_partition(producer, PARTITIONS))
        start = time.perf_counter()
        async with r.pipeline(transaction=False) as pipe:
            for _ in range(self.args.records):
                pipe.xadd(key, self.fields)  # type: ignore[arg-type]
            await pipe.execute()
        return time.perf_counter() - start

    async def closed_loop(self, kind: str) -> tuple[float, list[float]]:
        self.generation += 1
        latencies: list[float] = []
        r = Redis.from_url(self.redis_url, max_connections=256)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            async def one(producer: str) -> None:
                for _ in range(self.args.batches):
                    latencies.append(await (self.push(session, producer) if kind == "service"
                                            else self.raw(r, producer)))

            start = time.perf_counter()
            await asyncio.gather(*(one(p) for p in self.producer_ids()))
            elapsed = time.perf_counter() - start
        await self.trim(r)
        await r.aclose()
        return len(latencies) / elapsed, latencies

    async def trim(self, r: Redis) -> None:
        for p in range(PARTITIONS):
            await r.xtrim(streams.partition_key(DATASET, p), maxlen=0)
            await r.delete(streams.partition_key("raw", p))

    async def open_loop(self, rate: float, *, attacker: bool) -> tuple[list[float], int]:
        """Each producer sends every producers/rate seconds for --seconds; returns the
        latencies from the scheduled times and the attacker's refused requests."""
        self.generation += 1
        interval = self.args.producers / rate
        latencies: list[float] = []
        refused = 0
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
            async def one(producer: str, offset: float) -> None:
                due = time.perf_counter() + offset
                end = time.perf_counter() + self.args.seconds
                while due < end:
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    await self.push(session, producer)
                    latencies.append(time.perf_counter() - due)
                    due += interval

            async def worst() -> None:
                nonlocal refused
                body = worst_case_body(self.args.max_push_bytes)
                while not stop.is_set():
                    async with session.post(
                        f"{self.base}/v1/datasets/{DATASET}/records",
                        params={"producer_id": "attacker", "seq": "0"}, data=body,
                        headers={"Authorization": f"Bearer {TOKEN}",
                                 "Content-Type": "application/x-ndjson"},
                    ) as resp:
                        await resp.read()
                        if resp.status != 413:
                            raise RuntimeError(f"the worst-case push answered {resp.status}")
                        refused += 1

            tasks = [asyncio.create_task(worst())] if attacker else []
            ids = self.producer_ids()
            await asyncio.gather(*(one(p, interval * i / len(ids)) for i, p in enumerate(ids)))
            stop.set()
            await asyncio.gather(*tasks)
        r = Redis.from_url(self.redis_url)
        await self.trim(r)
        await r.aclose()
        return latencies, refused


def worst_case_body(limit: int) -> bytes:
    """Lines of ~1.6 KB JSON arrays up to the byte limit, the last line a record over
    the dataset's max_record_bytes: everything is read and parsed, then refused."""
    line = ("[" + ",".join(["100"] * 400) + "]\n").encode()
    last = b'"' + b"z" * 5000 + b'"\n'
    count = min(9_999, (limit - len(last)) // len(line))
    return line * count + last


async def setup(redis_url: str) -> None:
    r = Redis.from_url(redis_url)
    await create_dataset(r, streams.DatasetSpec(name=DATASET, partitions=PARTITIONS,
                                                format="push", max_record_bytes=4096))
    await r.aclose()


def wait_ready(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("trainguard serve exited")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("trainguard serve did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--producers", type=int, default=32)
    parser.add_argument("--batches", type=int, default=20, help="per producer per round")
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=10.0, help="per open-loop phase")
    parser.add_argument("--max-push-bytes", type=int, default=16 * 1024 * 1024)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-push-"))
    server = RedisServer(tmp / "redis").start()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRAINGUARD_REDIS_URL": server.url,
           "TRAINGUARD_PUSH_TOKENS": f"{TOKEN}:{DATASET}:*"}
    asyncio.run(setup(server.url))
    proc = subprocess.Popen([sys.executable, "-m", "trainguard", "serve", "--port", str(port),
                             "--no-produce"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready(base, proc)
        bench = Bench(args, server.url, base)
        print(f"{args.producers} producers x batches of {args.records} x {args.record_bytes} B; "
              f"redis :{server.port}, service :{port} (pid {proc.pid})")
        rss0 = rss_mb(proc.pid)
        svc_lat: list[float] = []
        raw_lat: list[float] = []
        ratios: list[float] = []
        rates: list[float] = []
        print(f"{'round':>5} | {'service batch/s':>15} | {'raw batch/s':>11} | {'ratio':>5} | "
              f"{'service RSS MB':>14}")
        for n in range(args.rounds):
            svc_rate, lat = asyncio.run(bench.closed_loop("service"))
            svc_lat += lat
            raw_rate, lat = asyncio.run(bench.closed_loop("raw"))
            raw_lat += lat
            ratios.append(svc_rate / raw_rate)
            rates.append(svc_rate)
            print(f"{n:>5} | {svc_rate:>15,.0f} | {raw_rate:>11,.0f} | {ratios[-1]:>5.2f} | "
                  f"{rss_mb(proc.pid):>14.0f}")
        ratios.sort()
        print(f"ratio service/raw: median {statistics.median(ratios):.2f} "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}); closed-loop batch latency "
              f"service p50 {pct(svc_lat, .5):.1f} ms p99 {pct(svc_lat, .99):.1f} ms, "
              f"raw p50 {pct(raw_lat, .5):.1f} ms p99 {pct(raw_lat, .99):.1f} ms")
        half = statistics.median(rates) / 2
        lat, _ = asyncio.run(bench.open_loop(half, attacker=False))
        print(f"open loop at half saturation ({half:,.0f} batch/s): p50 {pct(lat, .5):.1f} ms "
              f"p99 {pct(lat, .99):.1f} ms over {len(lat)} batches; RSS {rss_mb(proc.pid):.0f} MB")
        lat, refused = asyncio.run(bench.open_loop(half, attacker=True))
        print(f"  + worst-case client ({len(worst_case_body(args.max_push_bytes)) / 2**20:.1f} MiB "
              f"bodies, {refused} refused with 413): p50 {pct(lat, .5):.1f} ms p99 "
              f"{pct(lat, .99):.1f} ms over {len(lat)} batches; RSS {rss_mb(proc.pid):.0f} MB "
              f"(at start {rss0:.0f} MB)")
    finally:
        proc.terminate()
        proc.wait(30)
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
