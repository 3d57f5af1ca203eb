"""Ingest benchmark: the trainguard producer against Redis' own XADD limit, in
interleaved rounds.

In one run against one fresh redis-server (started here on a free port, no
persistence), for records of 100 B, 8 KiB and 128 KiB:

1. raw: ``redis-cli --pipe`` fed pre-encoded ``XADD <partition> <id> d <payload>``
   commands, spread over the same partitions: what Redis itself takes;
2. trainguard: the Producer from a file source (a uint8 ``.npy`` cut into records of
   that size), shuffle, deterministic IDs, pipelined XADDs with explicit IDs.

Each size runs ``--rounds`` rounds (plus one warm-up, discarded) of both, the order
rotated each round, Redis flushed between runs. Prints per size the median records/s
and MB/s of each, the client CPU per GiB (redis-cli's for raw, the producer process's
for trainguard), and the headline ratio: the median of the per-round ratios, with
their range. 100 B records use ``--mb-small`` MB (a record costs the same whatever
its size, so fewer bytes give as many records per second). Merges an ``ingest``
section into the JSON results file.
Usage: python bench/ingest.py [--mb 256] [--mb-small 32] [--partitions 16] [--rounds 6]
                              [--sizes 100,8192,131072]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402
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


def run_raw(port: int, path: Path) -> None:
    with open(path, "rb") as f:
        done = subprocess.run(["redis-cli", "-p", str(port), "--pipe"], stdin=f,
                              capture_output=True, text=True, check=True)
    if "errors: 0" not in done.stdout:
        raise RuntimeError(f"redis-cli --pipe reported errors: {done.stdout}")


async def run_trainguard(url: str, source: Path, size: int, partitions: int) -> int:
    client = Redis.from_url(url)
    spec = streams.DatasetSpec(name=f"tg{size}", partitions=partitions, source=str(source),
                               format="npy", sample_len=size, shuffle_buffer=1024)
    producer = Producer(client, spec)
    try:
        await producer.run()
    finally:
        await client.aclose()
    return producer.progress.records


def measure_size(server: RedisServer, tmp: Path, size: int, mb: int, args: argparse.Namespace,
                 flush: redis.Redis) -> tuple[rd.Rounds, rd.Ratio, int]:
    count = max(1000, mb * 1_000_000 // size)
    cmds = tmp / f"raw-{size}.resp"
    write_raw_commands(cmds, count, size, args.partitions)
    source = tmp / f"tokens-{size}.npy"
    np.save(source, np.full(count * size, ord("x"), dtype=np.uint8))

    def raw() -> int:
        run_raw(server.port, cmds)
        return count * size

    def tg() -> int:
        records = asyncio.run(run_trainguard(server.url, source, size, args.partitions))
        if records != count:
            raise RuntimeError(f"producer appended {records} records, expected {count}")
        return count * size

    try:
        assert server.proc is not None
        r = rd.run_rounds({"raw redis-cli --pipe": raw, "trainguard producer": tg},
                          rounds=args.rounds, after=lambda _: flush.flushall(),
                          server_pid=server.proc.pid)
    finally:
        cmds.unlink()
        source.unlink()
    ratio = rd.speed_ratio(r, "trainguard producer", "raw redis-cli --pipe",
                           name=f"{size} B: producer / raw redis-cli --pipe",
                           target={100: ">= 0.5x", 8192: ">= 0.8x"}.get(size, ""))
    return r, ratio, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="payload MB per record size")
    parser.add_argument("--mb-small", type=int, default=32, help="payload MB of 100 B records")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="record sizes in bytes, comma-separated")
    parser.add_argument("--json", help="results file (default: bench/results/<host>-<stamp>.json)")
    args = parser.parse_args()
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: install redis-tools / redis-server")
    out = rd.results_path() if args.json is None else Path(args.json)
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ingest-"))
    server = RedisServer(tmp / "redis").start()
    flush = redis.Redis(port=server.port)
    section: dict[str, Any] = {"args": vars(args), "sizes": {}}
    ratios: list[rd.Ratio] = []
    try:
        print(f"redis-server :{server.port}, {args.partitions} partitions, {args.mb} MB of "
              f"payload per size ({args.mb_small} MB at 100 B), {args.rounds} rounds + 1 "
              "warm-up", flush=True)
        print(f"{'size':>8} {'records':>9} | {'raw rec/s':>11} {'raw MB/s':>9} | "
              f"{'tg rec/s':>11} {'tg MB/s':>9} | {'client CPU s/GiB raw, tg':>24} | "
              f"{'redis CPU s/GiB raw, tg':>23}")
        for size in (int(s) for s in args.sizes.split(",")):
            r, ratio, count = measure_size(server, tmp, size,
                                           args.mb_small if size < 1024 else args.mb, args, flush)
            ratios.append(ratio)
            raw_s, tg_s = r.median_wall("raw redis-cli --pipe"), r.median_wall("trainguard producer")
            mb = count * size / 1e6
            raw_cpu = r.cpu_per_gib("raw redis-cli --pipe") or 0.0
            tg_cpu = r.cpu_per_gib("trainguard producer") or 0.0
            raw_srv = r.server_cpu_per_gib("raw redis-cli --pipe") or 0.0
            tg_srv = r.server_cpu_per_gib("trainguard producer") or 0.0
            print(f"{size:>8} {count:>9} | {count / raw_s:>11,.0f} {mb / raw_s:>9,.1f} | "
                  f"{count / tg_s:>11,.0f} {mb / tg_s:>9,.1f} | {raw_cpu:>11.2f} {tg_cpu:>12.2f} | "
                  f"{raw_srv:>11.2f} {tg_srv:>11.2f}", flush=True)
            section["sizes"][str(size)] = {
                "records": count, "raw_mb_s": round(mb / raw_s, 1), "tg_mb_s": round(mb / tg_s, 1),
                "raw_cpu_s_per_gib": round(raw_cpu, 3), "tg_cpu_s_per_gib": round(tg_cpu, 3),
                "raw_redis_cpu_s_per_gib": round(raw_srv, 3),
                "tg_redis_cpu_s_per_gib": round(tg_srv, 3),
                "rows": rd.rows_doc(r),
            }
    finally:
        flush.close()
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    rd.print_headlines(ratios)
    section["headlines"] = {h.name: h.doc() for h in ratios}
    rd.write_section(out, "ingest", section, rd.machine())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
