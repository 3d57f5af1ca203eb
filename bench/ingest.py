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

With ``--cluster`` each round also runs both on a Redis Cluster (3 masters, 3
replicas, started here): raw is then one ``redis-cli --pipe`` per master, fed that
master's partitions, all at once; the headlines add the producer on the cluster
against raw on the cluster, and against the producer on single Redis, round by round.
Usage: python bench/ingest.py [--mb 256] [--mb-small 32] [--partitions 16] [--rounds 6]
                              [--sizes 100,8192,131072] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402

from ingest_service import redis_client  # noqa: E402
from ingest_service.producer.producer import Producer  # noqa: E402
from tests.servers import RedisCluster, RedisServer  # noqa: E402
from trainguard.core import streams  # noqa: E402

SIZES = (100, 8 * 1024, 128 * 1024)


def _bulk(b: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(b), b)


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


def run_raw(files: dict[int, Path]) -> None:
    """Every server's ``redis-cli --pipe`` at once, until the last is done."""
    procs = []
    for port, path in files.items():
        with open(path, "rb") as f:
            procs.append(subprocess.Popen(["redis-cli", "-p", str(port), "--pipe"], stdin=f,
                                          stdout=subprocess.PIPE, text=True))
    for proc in procs:
        out = proc.communicate()[0]
        if proc.returncode != 0 or "errors: 0" not in out:
            raise RuntimeError(f"redis-cli --pipe reported errors: {out}")


def flushall(target: RedisServer | RedisCluster) -> None:
    if isinstance(target, RedisCluster):
        target.flushall()
        return
    client = redis.Redis(port=target.port)
    client.flushall()
    client.close()


async def run_trainguard(url: str, source: Path, size: int, partitions: int) -> int:
    client = redis_client.client(url)
    spec = streams.DatasetSpec(name=f"tg{size}", partitions=partitions, source=str(source),
                               format="npy", sample_len=size, shuffle_buffer=1024)
    producer = Producer(client, spec)
    try:
        await producer.run()
    finally:
        await client.aclose()
    return producer.progress.records


def measure_size(targets: list[tuple[str, RedisServer | RedisCluster]], tmp: Path, size: int,
                 mb: int, args: argparse.Namespace) -> tuple[rd.Rounds, list[rd.Ratio], int]:
    count = max(1000, mb * 1_000_000 // size)
    source = tmp / f"tokens-{size}.npy"
    np.save(source, np.full(count * size, ord("x"), dtype=np.uint8))
    contestants: dict[str, Callable[[], int]] = {}
    pids: dict[str, list[int]] = {}
    flushes: dict[str, Callable[[], None]] = {}
    files: list[Path] = []

    def add(name: str, target: RedisServer | RedisCluster) -> None:
        cmds = write_raw_commands(tmp / name, count, size, masters(target, args.partitions))
        files.extend(cmds.values())

        def raw() -> int:
            run_raw(cmds)
            return count * size

        def tg() -> int:
            records = asyncio.run(run_trainguard(target.url, source, size, args.partitions))
            if records != count:
                raise RuntimeError(f"producer appended {records} records, expected {count}")
            return count * size

        servers = target.nodes if isinstance(target, RedisCluster) else [target]
        for label, fn in ((raw_name(name), raw), (tg_name(name), tg)):
            contestants[label] = fn
            pids[label] = [s.pid for s in servers if s.pid is not None]
            flushes[label] = lambda: flushall(target)

    for name, target in targets:
        (tmp / name).mkdir(exist_ok=True)
        add(name, target)
    try:
        r = rd.run_rounds(contestants, rounds=args.rounds, after=lambda n: flushes[n](),
                          server_pids=pids)
    finally:
        for path in files:
            path.unlink()
        source.unlink()
    target_of = {100: ">= 0.5x", 8192: ">= 0.8x"}.get(size, "")
    ratios = [rd.speed_ratio(r, tg_name("single"), raw_name("single"),
                             name=f"{size} B: producer / raw redis-cli --pipe", target=target_of)]
    if len(targets) > 1:
        ratios += [
            rd.speed_ratio(r, tg_name("cluster"), raw_name("cluster"),
                           name=f"{size} B cluster: producer / raw --pipe per master",
                           target=">= 0.8x"),
            rd.speed_ratio(r, tg_name("cluster"), tg_name("single"),
                           name=f"{size} B: producer on cluster / on single Redis"),
        ]
    return r, ratios, count


def raw_name(target: str) -> str:
    return "raw redis-cli --pipe" + ("" if target == "single" else f" ({target})")


def tg_name(target: str) -> str:
    return "trainguard producer" + ("" if target == "single" else f" ({target})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="payload MB per record size")
    parser.add_argument("--mb-small", type=int, default=32, help="payload MB of 100 B records")
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="record sizes in bytes, comma-separated")
    parser.add_argument("--json", help="results file (default: bench/results/<host>-<stamp>.json)")
    parser.add_argument("--cluster", action="store_true",
                        help="also on a Redis Cluster (3 masters + 3 replicas)")
    args = parser.parse_args()
    if shutil.which("redis-cli") is None:
        raise SystemExit("redis-cli is not on PATH: install redis-tools / redis-server")
    out = rd.results_path() if args.json is None else Path(args.json)
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ingest-"))
    targets: list[tuple[str, RedisServer | RedisCluster]] = [
        ("single", RedisServer(tmp / "redis").start())]
    if args.cluster:
        targets.append(("cluster", RedisCluster(tmp / "cluster").start()))
    section: dict[str, Any] = {"args": vars(args), "sizes": {}}
    ratios: list[rd.Ratio] = []
    try:
        print(f"{', '.join(n for n, _ in targets)}: {args.partitions} partitions, {args.mb} MB "
              f"of payload per size ({args.mb_small} MB at 100 B), {args.rounds} rounds + 1 "
              "warm-up", flush=True)
        print(f"{'redis':>7} {'size':>8} {'records':>9} | {'raw rec/s':>11} {'raw MB/s':>9} | "
              f"{'tg rec/s':>11} {'tg MB/s':>9} | {'client CPU s/GiB raw, tg':>24} | "
              f"{'redis CPU s/GiB raw, tg':>23}")
        for size in (int(s) for s in args.sizes.split(",")):
            r, size_ratios, count = measure_size(
                targets, tmp, size, args.mb_small if size < 1024 else args.mb, args)
            ratios += size_ratios
            mb = count * size / 1e6
            doc: dict[str, Any] = {"records": count, "rows": rd.rows_doc(r)}
            for name, _ in targets:
                raw, tg = raw_name(name), tg_name(name)
                raw_s, tg_s = r.median_wall(raw), r.median_wall(tg)
                raw_cpu, tg_cpu = r.cpu_per_gib(raw) or 0.0, r.cpu_per_gib(tg) or 0.0
                raw_srv = r.server_cpu_per_gib(raw) or 0.0
                tg_srv = r.server_cpu_per_gib(tg) or 0.0
                print(f"{name:>7} {size:>8} {count:>9} | {count / raw_s:>11,.0f} "
                      f"{mb / raw_s:>9,.1f} | {count / tg_s:>11,.0f} {mb / tg_s:>9,.1f} | "
                      f"{raw_cpu:>11.2f} {tg_cpu:>12.2f} | {raw_srv:>11.2f} {tg_srv:>11.2f}",
                      flush=True)
                prefix = "" if name == "single" else f"{name}_"
                doc |= {
                    f"{prefix}raw_mb_s": round(mb / raw_s, 1), f"{prefix}tg_mb_s": round(mb / tg_s, 1),
                    f"{prefix}raw_cpu_s_per_gib": round(raw_cpu, 3),
                    f"{prefix}tg_cpu_s_per_gib": round(tg_cpu, 3),
                    f"{prefix}raw_redis_cpu_s_per_gib": round(raw_srv, 3),
                    f"{prefix}tg_redis_cpu_s_per_gib": round(tg_srv, 3),
                }
            section["sizes"][str(size)] = doc
    finally:
        for _, target in targets:
            if isinstance(target, RedisCluster):
                target.stop()
            else:
                target.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    rd.print_headlines(ratios)
    section["headlines"] = {h.name: h.doc() for h in ratios}
    rd.write_section(out, "ingest", section, rd.machine())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
