"""A light HTTP load generator for ``bench/push.py``: pre-encoded push requests over raw
asyncio streams, one keep-alive connection per producer, in a process of its own.

Why not aiohttp's client: on a 2-core machine shared by the generator, the service and
Redis, a heavier client takes CPU from the service it measures, and its own pauses
(its event loop, its garbage collector) show up as the service's latency. Here a
request costs the client a few string formats and two socket writes; the body is
encoded once; the collector is frozen after setup (the client keeps nothing cyclic).

Modes (one JSON line on stdout with the figures):

- ``closed``: every producer sends ``--batches`` batches back to back; reports batches/s.
- ``open``: every producer sends on its own schedule at ``rate / producers`` batches/s,
  the producers' schedules staggered evenly over one interval (``--arrivals even``) or
  each a Poisson process (``--arrivals poisson``). Latency counts from the scheduled
  send time, not from when the request went out: a producer still waiting for its
  previous answer (a push protocol sends batch ``seq`` after ``seq - 1`` is in) sends
  late, and that wait counts (no coordinated omission).

Usage: python bench/push_load.py --port P --token T --prefix actor-1 --mode open --rate 250
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import time

import msgpack


class Producer:
    """One producer_id on one keep-alive connection, sending seq 0, 1, 2, ..."""

    def __init__(self, args: argparse.Namespace, producer_id: str, body: bytes) -> None:
        self.args, self.producer_id, self.body = args, producer_id, body
        self.seq = 0
        self.head = (
            f"POST /v1/datasets/{args.dataset}/records?producer_id={producer_id}&seq={{seq}} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{args.port}\r\nAuthorization: Bearer {args.token}\r\n"
            f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.args.port)

    async def push(self) -> None:
        assert self.reader is not None and self.writer is not None
        self.writer.write(self.head.format(seq=self.seq).encode())
        self.writer.write(self.body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        answer = await self.reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"push answered {status}: {answer[:300]!r}")
        self.seq += 1

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def closed(producers: list[Producer], batches: int) -> dict[str, object]:
    latencies: list[float] = []

    async def one(p: Producer) -> None:
        for _ in range(batches):
            start = time.perf_counter()
            await p.push()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(one(p) for p in producers))
    elapsed = time.perf_counter() - start
    return {"rate": len(latencies) / elapsed, "latencies": latencies}


async def opened(producers: list[Producer], rate: float, seconds: float, arrivals: str,
                 seed: int) -> dict[str, object]:
    interval = len(producers) / rate
    latencies: list[float] = []
    service: list[float] = []
    late: list[float] = []
    rng = random.Random(seed)
    begin = time.perf_counter() + 0.05
    end = begin + seconds

    async def one(p: Producer, first: float) -> None:
        due = first
        while due < end:
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            sent = time.perf_counter()
            await p.push()
            done = time.perf_counter()
            latencies.append(done - due)
            service.append(done - sent)
            late.append(sent - due)
            due += rng.expovariate(1 / interval) if arrivals == "poisson" else interval

    if arrivals == "poisson":
        firsts = [begin + rng.expovariate(1 / interval) for _ in producers]
    else:
        firsts = [begin + interval * i / len(producers) for i in range(len(producers))]
    await asyncio.gather(*(one(p, f) for p, f in zip(producers, firsts, strict=True)))
    return {"rate": len(latencies) / (time.perf_counter() - begin), "latencies": latencies,
            "service": service, "late": late}


async def run(args: argparse.Namespace) -> dict[str, object]:
    body = msgpack.packb([os.urandom(args.record_bytes)] * args.records, use_bin_type=True)
    producers = [Producer(args, f"{args.prefix}-{i}", body) for i in range(args.producers)]
    await asyncio.gather(*(p.connect() for p in producers))
    gc.collect()
    gc.freeze()  # nothing the generator allocates from here on is cyclic garbage
    cpu = time.process_time()
    try:
        if args.mode == "closed":
            result = await closed(producers, args.batches)
        else:
            result = await opened(producers, args.rate, args.seconds, args.arrivals, args.seed)
    finally:
        for p in producers:
            p.close()
    result["cpu_s"] = time.process_time() - cpu
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--dataset", default="rollouts", help="a push dataset")
    parser.add_argument("--prefix", required=True, help="producer_ids are <prefix>-<i>")
    parser.add_argument("--mode", choices=("closed", "open"), required=True)
    parser.add_argument("--producers", type=int, default=32)
    parser.add_argument("--records", type=int, default=100)
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=20, help="closed: per producer")
    parser.add_argument("--rate", type=float, default=100.0, help="open: batches/s, all producers")
    parser.add_argument("--seconds", type=float, default=10.0, help="open: schedule length")
    parser.add_argument("--arrivals", choices=("even", "poisson"), default="even")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
