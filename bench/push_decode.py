"""Where a push body is best decoded: the figures behind the decode pool's settings.

1. Thread or process (``--rounds`` rounds of 3 s each, interleaved): the event loop's
   lag over a 1 ms timer with nothing else running, beside a thread decoding the
   msgpack-under body (100 records of 9,998 lists) in a loop, and beside a decode
   worker process (:class:`~ingest_service.push.decode_pool.DecodePool`) doing the
   same. msgpack's C decoder holds the GIL for a whole record, so the thread holds
   the loop's thread.
2. The crossover: the loop thread's CPU per body (median of 7, the two ways
   interleaved), parsed inline (``parse_records_sliced``) and through a worker, for
   msgpack bodies of 1 KB ``bin`` records from 4 KiB to 4 MiB, 100 small maps and one
   record of 9,998 lists; with the header walk's cost (``needs_worker``'s count).
Prints the load average at the start and the end. Usage: python bench/push_decode.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ingest_service.push.body import BodyLimits, parse_records, parse_records_sliced
from ingest_service.push.decode_pool import DecodePool, _msgpack_values

LIMITS = BodyLimits()
MSGPACK = "application/msgpack"
UNDER = msgpack.packb([[[]] * 9998] * 100)


async def _ticker(stop: asyncio.Event) -> list[float]:
    gaps, last = [], time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append((now - last - 0.001) * 1000)
        last = now
    return gaps


async def _lag(mode: str, seconds: float = 3.0) -> str:
    stop = asyncio.Event()
    pool = DecodePool(LIMITS) if mode == "process" else None
    if pool is not None:  # started before the clock runs
        await pool.parse(bytearray(msgpack.packb([[[]] * 2000])), MSGPACK, 16 << 20)
    ticks = asyncio.ensure_future(_ticker(stop))
    end, bodies = time.perf_counter() + seconds, 0
    if mode == "thread":
        def work() -> None:
            nonlocal bodies
            while time.perf_counter() < end:
                parse_records(bytearray(UNDER), MSGPACK, 16 << 20, LIMITS)
                bodies += 1
        thread = threading.Thread(target=work)
        thread.start()
        while thread.is_alive():
            await asyncio.sleep(0.05)
    elif pool is not None:
        while time.perf_counter() < end:
            await pool.parse(bytearray(UNDER), MSGPACK, 16 << 20)
            bodies += 1
        await pool.close()
    else:
        await asyncio.sleep(seconds)
    stop.set()
    g = sorted(await ticks)
    return (f"{mode:>8}: {bodies} bodies; loop lag over a 1 ms timer p50 {g[len(g) // 2]:.2f} "
            f"p99 {g[int(.99 * len(g))]:.2f} max {g[-1]:.2f} ms ({len(g)} ticks); load "
            f"{os.getloadavg()[0]:.1f}")


def _bodies() -> Iterator[tuple[str, bytes]]:
    for kib in (4, 16, 64, 256, 1024, 4096):
        yield f"bin {kib}x1KB", msgpack.packb([os.urandom(1000) for _ in range(kib)])
    yield "maps 100x5", msgpack.packb([{"a": i, "b": "x" * 20, "c": [1, 2, 3], "d": 1.5,
                                        "e": b"y" * 100} for i in range(100)])
    yield "lists 1x9998", msgpack.packb([[[]] * 9998])


async def _crossover() -> None:
    pool = DecodePool(LIMITS)
    await pool.parse(bytearray(msgpack.packb([[[]] * 2000])), MSGPACK, 16 << 20)
    for name, body in _bodies():
        t = time.thread_time()
        values = _msgpack_values(body, LIMITS.inline_values)
        walk = time.thread_time() - t
        inline, worker = [], []
        for _ in range(7):
            t = time.thread_time()
            await parse_records_sliced(bytearray(body), MSGPACK, 16 << 20, LIMITS)
            inline.append(time.thread_time() - t)
            t = time.thread_time()
            await pool.parse(bytearray(body), MSGPACK, 16 << 20)
            worker.append(time.thread_time() - t)
        print(f"  {name:>13} {len(body) / 1024:6.0f} KiB, values walked {values:4d} "
              f"({walk * 1e3:.2f} ms): loop CPU inline {statistics.median(inline) * 1e3:.3f} ms, "
              f"through a worker {statistics.median(worker) * 1e3:.3f} ms")
    await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(f"load average at start {os.getloadavg()[0]:.1f}")
    print("1. thread or process")
    for _ in range(args.rounds):
        for mode in ("none", "thread", "process"):
            print("  " + asyncio.run(_lag(mode)))
    print("2. crossover")
    asyncio.run(_crossover())
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
