"""Consumer throughput: StreamingDataset against the raw Redis read limit and against
torch's own DataLoader limit, in interleaved rounds.

One redis-server (started here on a free port), a dataset of P partitions filled with
records of 8 KiB and of 128 KiB (NumPy uint8 arrays, the contract's ``nd`` kind). For
each size, every round runs (order rotated each round, first round discarded):

1. raw: pipelined XRANGE of every partition, replies read but not decoded (the
   limit of one process reading Redis); and raw XREADGROUP, the same pipelines
   reading a new consumer group (the group read alone: what its bookkeeping adds,
   and on a cluster its replication to the replicas);
2. StreamingDataset iterated in this process (fenced XREADGROUP, batch tensors);
3. baseline for the worker path: an in-memory ``IterableDataset`` yielding batch
   tensors of the same shape and bytes (a fresh tensor per batch, as any dataset
   that builds batches does) through ``DataLoader(num_workers=2)``: torch's own cost
   of moving batches between processes, with no Redis at all;
4. StreamingDataset through the same ``DataLoader(num_workers=2)``.

Prints a table (median seconds, GiB/s, client CPU s/GiB) and the headline ratios
(median of per-round ratios, with their range), then the time a checkpoint spends
committing offsets, with a ``TrainingSession`` on a local checkpoint store. Merges a
``consume`` section into the JSON results file.

With ``--cluster`` the same contestants also run on a Redis Cluster (3 masters, 3
replicas, started here) in the same rounds, raw meaning pipelined XRANGE (or
XREADGROUP) to each partition's master (every master's commands written before any
reply is read); the headlines add the cluster against its raw figures and against
single Redis, and the offset commit is timed on both.

    .venv/bin/python bench/consume.py                   # 256 MiB per size, 6 rounds
    .venv/bin/python bench/consume.py --mb 512 --rounds 6
    .venv/bin/python bench/consume.py --mb 64 --cluster
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import redis
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402

from tests.servers import RedisCluster, RedisServer  # noqa: E402
from trainer_client import (  # noqa: E402
    StreamingDataset,
    TrainingSession,
    redis_client,
)
from trainguard.core import streams  # noqa: E402

WORKERS = 2


def fill(url: str, name: str, partitions: int, size: int, count: int) -> None:
    spec = streams.DatasetSpec(name=name, partitions=partitions, source="bench://", format="npy",
                               sample_len=size)
    client = redis_client.client(url)
    client.hset(streams.meta_key(name), mapping=spec.to_redis())
    client.sadd(streams.datasets_key(), name)
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    fields = streams.encode_record(payload)
    per = [0] * partitions
    pipe = client.pipeline(transaction=False)
    for i in range(count):
        p = i % partitions
        pipe.xadd(streams.partition_key(name, p), fields, id=streams.make_id(0, per[p]))
        per[p] += 1
        if i % 256 == 255:
            pipe.execute()
    pipe.execute()
    progress = {streams.PROGRESS_FINISHED: b"1"}
    for p in range(partitions):
        if per[p]:
            progress[streams.progress_end_field(p)] = streams.make_id(0, per[p] - 1).encode()
    client.hset(streams.progress_key(name), mapping=progress)
    client.close()


def masters(url: str, name: str, partitions: int) -> dict[int, tuple[str, int]]:
    """Where each partition is served: the one server, or its slot's master."""
    client = redis_client.client(url)
    try:
        if not redis_client.is_cluster(client):
            kw = client.connection_pool.connection_kwargs
            return {p: (kw["host"], kw["port"]) for p in range(partitions)}
        nodes = {p: client.get_node_from_key(streams.partition_key(name, p))  # type: ignore[attr-defined]
                 for p in range(partitions)}
        return {p: (n.host, n.port) for p, n in nodes.items()}
    finally:
        client.close()


def raw_read(where: dict[int, tuple[str, int]], name: str, chunk: int, group: str | None = None
             ) -> int:
    """Bytes of record payload read with pipelined XRANGE (one pipeline per server,
    every server's commands written before any reply is read), replies parsed by
    hiredis but not turned into Python dicts (redis-py's response callbacks are
    bypassed). With ``group``, XREADGROUP of that (new) consumer group instead, the
    same way: the consumer-group read alone, without fences or batches (the group's
    bookkeeping, and on a cluster its replication, is what XRANGE does not pay)."""
    conns = {}
    for addr in set(where.values()):
        conns[addr] = redis.Connection(host=addr[0], port=addr[1], protocol=2)
        conns[addr].connect()
    if group is not None:
        for p, addr in where.items():
            conns[addr].send_command("XGROUP", "CREATE", streams.partition_key(name, p), group, "0")
            conns[addr].read_response()
    starts = {p: "-" for p in where}
    total = 0
    while starts:
        order = list(starts)
        for addr, conn in conns.items():
            cmds = [("XRANGE", streams.partition_key(name, p), starts[p], "+", "COUNT", chunk)
                    if group is None else
                    ("XREADGROUP", "GROUP", group, "raw", "COUNT", chunk,
                     "STREAMS", streams.partition_key(name, p), ">")
                    for p in order if where[p] == addr]
            if cmds:
                conn.send_packed_command(conn.pack_commands(cmds))
        for addr, conn in conns.items():
            for p in (p for p in order if where[p] == addr):
                entries = conn.read_response()
                if group is not None:
                    entries = entries[0][1] if entries else []
                for _eid, flat in entries:
                    total += len(flat[3])  # k, kind, d, <payload>, ...
                if len(entries) < chunk:
                    del starts[p]
                else:
                    starts[p] = "(" + entries[-1][0].decode()
    for conn in conns.values():
        conn.disconnect()
    return total


class InMemory(IterableDataset[torch.Tensor]):
    """``batches`` batch tensors like ``template``, split over the workers; each batch
    a fresh tensor (a clone), as a dataset that builds its batches yields them."""

    def __init__(self, template: torch.Tensor, batches: int):
        super().__init__()
        self.template = template
        self.batches = batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for _ in range(w, self.batches, n):
            yield self.template.clone()


class Consume:
    def __init__(self, url: str, name: str, partitions: int, size: int, count: int):
        self.url, self.name = url, name
        self.where = masters(url, name, partitions)
        self.partitions, self.size, self.count = partitions, size, count
        self.batch = max(1, (1024 * 1024) // size)  # ~1 MiB batches
        self.groups = itertools.count()
        self.template = torch.from_numpy(
            np.random.default_rng(1).integers(0, 255, (self.batch, size), dtype=np.uint8))

    def _group(self) -> str:
        return f"grp-{next(self.groups)}"

    def raw(self) -> int:
        return raw_read(self.where, self.name, self.batch)

    def raw_group(self) -> int:
        return raw_read(self.where, self.name, self.batch, self._group())

    def streaming(self, workers: int | None) -> int:
        ds = StreamingDataset(self.url, self.name, self._group(), batch_size=self.batch)
        source = ds if workers is None else DataLoader(ds, batch_size=None, num_workers=workers)
        total = 0
        for b in source:
            total += b.data.numel() * b.data.element_size()
        return total

    def in_memory(self) -> int:
        batches = -(-self.count // self.batch)
        loader = DataLoader(InMemory(self.template, batches), batch_size=None,
                            num_workers=WORKERS)
        total = 0
        for t in loader:
            total += t.numel() * t.element_size()
        return total

    def drop_groups(self, _: str) -> None:
        client = redis_client.client(self.url)
        for p in range(self.partitions):
            key = streams.partition_key(self.name, p)
            for g in client.xinfo_groups(key):
                client.xgroup_destroy(key, g["name"])
        client.close()


def commit_cost(url: str, name: str, store_dir: str, batch: int, rounds: int) -> list[float]:
    session = TrainingSession(url, dataset=name, run="commitbench", store=f"file://{store_dir}",
                              keep_last=2)
    model = torch.nn.Linear(16, 16)
    state = {"model": model}
    session.restore(state)
    it = iter(session.batches(session.dataset(batch_size=batch)))
    costs = []
    for step in range(1, rounds + 1):
        for _ in range(4):
            next(it)
        session.checkpoint(state, step, blocking=True)
        assert session.last_commit_offsets_s is not None
        costs.append(session.last_commit_offsets_s)
    session.close()
    return costs


RAW, RAW_GROUP, ONE, BASE, DL = ("raw XRANGE", "raw XREADGROUP", "StreamingDataset, 1 process",
                      f"in-memory IterableDataset, DataLoader({WORKERS} workers)",
                      f"StreamingDataset, DataLoader({WORKERS} workers)")


def on(label: str, target: str) -> str:
    return label if target == "single" else f"{label} [{target}]"


def measure_size(targets: dict[str, tuple[str, list[int]]], args: argparse.Namespace, kib: int
                 ) -> tuple[rd.Rounds, list[rd.Ratio], int]:
    """``targets``: name -> (Redis URL, server pids). Every contestant on every target,
    in the same rounds; the in-memory baseline once."""
    size = kib * 1024
    count = max(args.partitions, args.mb * 1024 * 1024 // size)
    name = f"bench{kib}"
    contestants: dict[str, Callable[[], int]] = {}
    pids: dict[str, list[int]] = {}
    cleanup: dict[str, Callable[[str], None]] = {}
    for target, (url, servers) in targets.items():
        fill(url, name, args.partitions, size, count)
        c = Consume(url, name, args.partitions, size, count)
        runs: dict[str, Callable[[], int]] = {
            RAW: c.raw, RAW_GROUP: c.raw_group, ONE: lambda c=c: c.streaming(None),
            DL: lambda c=c: c.streaming(WORKERS)}
        if target == "single":
            runs[BASE] = c.in_memory
        for label, fn in runs.items():
            contestants[on(label, target)] = fn
            pids[on(label, target)] = servers
            cleanup[on(label, target)] = c.drop_groups
    r = rd.run_rounds(contestants, rounds=args.rounds, after=lambda n: cleanup[n](n),
                      server_pids=pids)
    moved = {n: {s.nbytes for s in r.samples[n]} for n in contestants}
    assert all(v == {count * size} for v in moved.values()), (moved, count * size)
    for url, _ in targets.values():
        client = redis_client.client(url)
        for p in range(args.partitions):
            client.delete(streams.partition_key(name, p))
        client.close()
    ratios = [
        rd.speed_ratio(r, DL, BASE, name=f"{kib} KiB: workers StreamingDataset / in-memory",
                       target=">= 0.8x"),
        rd.speed_ratio(r, ONE, RAW, name=f"{kib} KiB: 1-process StreamingDataset / raw XRANGE",
                       target=">= 0.8x" if kib == 128 else ""),
        rd.speed_ratio(r, DL, RAW, name=f"{kib} KiB: workers StreamingDataset / raw XRANGE"),
        rd.speed_ratio(r, ONE, RAW_GROUP,
                       name=f"{kib} KiB: 1-process StreamingDataset / raw XREADGROUP"),
    ]
    if "cluster" in targets:
        cl = "cluster"
        ratios += [
            rd.speed_ratio(r, on(ONE, cl), on(RAW, cl), target=">= 0.8x",
                           name=f"{kib} KiB cluster: 1-process StreamingDataset / raw XRANGE"),
            rd.speed_ratio(r, on(DL, cl), on(RAW, cl),
                           name=f"{kib} KiB cluster: workers StreamingDataset / raw XRANGE"),
            rd.speed_ratio(r, on(ONE, cl), on(RAW_GROUP, cl),
                           name=f"{kib} KiB cluster: 1-process StreamingDataset / raw XREADGROUP"),
            rd.speed_ratio(r, on(RAW_GROUP, cl), on(RAW, cl),
                           name=f"{kib} KiB cluster: raw XREADGROUP / raw XRANGE"),
            rd.speed_ratio(r, on(ONE, cl), ONE,
                           name=f"{kib} KiB: 1-process StreamingDataset, cluster / single"),
        ]
    return r, ratios, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="MiB of records per record size")
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--sizes-kib", default="8,128")
    ap.add_argument("--rounds", type=int, default=6, help="measured rounds per size")
    ap.add_argument("--json", help="results file (default: bench/results/<host>-<stamp>.json)")
    ap.add_argument("--cluster", action="store_true",
                    help="also on a Redis Cluster (3 masters + 3 replicas), in the same rounds")
    args = ap.parse_args()
    out = rd.results_path() if args.json is None else Path(args.json)
    section: dict[str, object] = {"args": vars(args) | {"workers": WORKERS}, "sizes": {}}
    headlines: list[rd.Ratio] = []
    commits: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        cluster = RedisCluster(Path(tmp) / "cluster").start() if args.cluster else None
        try:
            targets = {"single": (server.url, [p for p in [server.pid] if p is not None])}
            if cluster is not None:
                targets["cluster"] = (cluster.url, [n.pid for n in cluster.nodes
                                                    if n.pid is not None])
            print(f"{', '.join(targets)}: {args.partitions} partitions, {args.mb} MiB per "
                  f"size, ~1 MiB batches, {args.rounds} rounds + 1 warm-up", flush=True)
            for kib in (int(s) for s in args.sizes_kib.split(",")):
                r, ratios, count = measure_size(targets, args, kib)
                print(f"\n[{kib} KiB x {count} records]")
                print(rd.table(r))
                headlines += ratios
                section["sizes"][str(kib)] = {"records": count, "rows": rd.rows_doc(r)}  # type: ignore[index]
            for target, (url, _) in targets.items():
                fill(url, "commits", args.partitions, 1024, 20000)
                costs = commit_cost(url, "commits", str(Path(tmp) / f"ckpt-{target}"), 64, 20)
                commits[target] = {"median_ms": round(statistics.median(costs) * 1e3, 3),
                                   "max_ms": round(max(costs) * 1e3, 3)}
        finally:
            server.kill()
            if cluster is not None:
                cluster.stop()
    for target, commit in commits.items():
        print(f"\ncommitting offsets after a checkpoint on {target} ({args.partitions} "
              f"partitions, 256 entries acknowledged each): median {commit['median_ms']:.2f} ms, "
              f"max {commit['max_ms']:.2f} ms")
    print()
    rd.print_headlines(headlines)
    section["commit_offsets"] = commits["single"]
    if "cluster" in commits:
        section["cluster_commit_offsets"] = commits["cluster"]
    section["headlines"] = {h.name: h.doc() for h in headlines}
    rd.write_section(out, "consume", section, rd.machine())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
