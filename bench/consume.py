"""Consumer throughput: raw Redis read limit vs StreamingDataset vs a DataLoader.

One redis-server (started here on a free port), a dataset of P partitions filled with
records of 8 KiB and of 128 KiB (NumPy uint8 arrays, the contract's ``nd`` kind). For
each size it measures, over the same entries:

1. raw: pipelined XRANGE of every partition, replies read but not decoded (the limit);
2. StreamingDataset iterated in this process (fenced XREADGROUP, batch tensors);
3. the same through ``DataLoader(num_workers=2)``;

and prints MB/s (best of 3 runs each) and the ratios to raw. With ``--cluster`` the
same runs on a Redis Cluster (3 masters, 3 replicas, started here) follow, with raw
meaning pipelined XRANGE to each partition's master, and the cluster's figures
against single Redis. Then the time a checkpoint spends committing
offsets (acknowledging and publishing them after the manifest commit), with a
``TrainingSession`` on a local checkpoint store.

    .venv/bin/python bench/consume.py --mb 64          # a small run
    .venv/bin/python bench/consume.py --mb 512 --partitions 16
    .venv/bin/python bench/consume.py --mb 64 --cluster
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.servers import RedisCluster, RedisServer  # noqa: E402
from trainer_client import (  # noqa: E402
    StreamingDataset,
    TrainingSession,
    redis_client,
)
from trainguard.core import streams  # noqa: E402


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


def raw_read(where: dict[int, tuple[str, int]], name: str, chunk: int) -> int:
    """Bytes of record payload read with pipelined XRANGE (one pipeline per server,
    every server's commands written before any reply is read), replies parsed by
    hiredis but not turned into Python dicts (redis-py's response callbacks are
    bypassed)."""
    conns = {}
    for addr in set(where.values()):
        conns[addr] = redis.Connection(host=addr[0], port=addr[1])
        conns[addr].connect()
    starts = {p: "-" for p in where}
    total = 0
    while starts:
        order = list(starts)
        for addr, conn in conns.items():
            cmds = [("XRANGE", streams.partition_key(name, p), starts[p], "+", "COUNT", chunk)
                    for p in order if where[p] == addr]
            if cmds:
                conn.send_packed_command(conn.pack_commands(cmds))
        for addr, conn in conns.items():
            for p in (p for p in order if where[p] == addr):
                entries = conn.read_response()
                for _eid, flat in entries:
                    total += len(flat[3])  # k, kind, d, <payload>, ...
                if len(entries) < chunk:
                    del starts[p]
                else:
                    starts[p] = "(" + entries[-1][0].decode()
    for conn in conns.values():
        conn.disconnect()
    return total


def dataset_read(url: str, name: str, group: str, batch: int, workers: int | None) -> int:
    ds = StreamingDataset(url, name, group, batch_size=batch)
    source = ds if workers is None else DataLoader(ds, batch_size=None, num_workers=workers)
    total = 0
    for b in source:
        total += b.data.numel() * b.data.element_size()
    return total


def timed(fn, *args, repeat: int = 3) -> tuple[float, float, int]:  # type: ignore[no-untyped-def]
    """Best of ``repeat`` runs (this machine is shared: the best run is the one least
    disturbed): wall seconds, this process's CPU seconds, bytes. A ``group`` argument
    gets a fresh suffix per run."""
    best, cpu, n = float("inf"), float("inf"), 0
    for r in range(repeat):
        call_args = [f"{a}-{r}" if isinstance(a, str) and a.startswith("grp") else a for a in args]
        t0, c0 = time.perf_counter(), time.process_time()
        n = fn(*call_args)
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return best, cpu, n


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="MiB of records per record size")
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--sizes-kib", default="8,128")
    ap.add_argument("--cluster", action="store_true",
                    help="also on a Redis Cluster (3 masters + 3 replicas), against single Redis")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis").start()
        cluster = RedisCluster(Path(tmp) / "cluster").start() if args.cluster else None
        try:
            figures = {"single": measure(server.url, args, Path(tmp) / "ckpt-single")}
            if cluster is not None:
                figures["cluster"] = measure(cluster.url, args, Path(tmp) / "ckpt-cluster")
                for key, single in figures["single"].items():
                    print(f"cluster / single Redis, {key}: {figures['cluster'][key] / single:.2f}x")
        finally:
            server.kill()
            if cluster is not None:
                cluster.stop()


def measure(url: str, args: argparse.Namespace, ckpt: Path) -> dict[str, float]:
    """Every figure of one Redis (a server or a cluster), printed; returns MB/s and the
    median commit time by name."""
    out: dict[str, float] = {}
    print(f"{url}: {args.partitions} partitions, {args.mb} MiB per size")
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        size = kib * 1024
        count = max(args.partitions, args.mb * 1024 * 1024 // size)
        name = f"bench{kib}"
        fill(url, name, args.partitions, size, count)
        batch = max(1, (1024 * 1024) // size)  # ~1 MiB batches
        chunk = max(1, batch)
        where = masters(url, name, args.partitions)
        t_raw, c_raw, n_raw = timed(raw_read, where, name, chunk)
        t_one, c_one, n_one = timed(dataset_read, url, name, "grp-one", batch, None)
        t_dl, _, n_dl = timed(dataset_read, url, name, "grp-dl2", batch, 2)
        assert n_raw == n_one == n_dl == count * size, (n_raw, n_one, n_dl, count * size)
        raw = n_raw / t_raw / 1e6
        one = n_one / t_one / 1e6
        dl = n_dl / t_dl / 1e6
        print(f"{kib:>4} KiB x {count}: raw XRANGE {raw:8.1f} MB/s | StreamingDataset "
              f"{one:8.1f} MB/s ({one / raw:.2f}x raw) | DataLoader(2 workers) "
              f"{dl:8.1f} MB/s ({dl / raw:.2f}x raw)")
        out[f"{kib} KiB raw MB/s"], out[f"{kib} KiB StreamingDataset MB/s"] = raw, one
        out[f"{kib} KiB DataLoader MB/s"] = dl
        gib = n_raw / 2**30
        print(f"{'':>4}     client CPU per GiB (less disturbed by a busy machine): raw "
              f"{c_raw / gib:.2f} s, StreamingDataset {c_one / gib:.2f} s")
        client = redis_client.client(url)
        for p in range(args.partitions):
            client.delete(streams.partition_key(name, p))
        client.close()
    fill(url, "commits", args.partitions, 1024, 20000)
    costs = commit_cost(url, "commits", str(ckpt), 64, 20)
    print(f"committing offsets after a checkpoint ({args.partitions} partitions, "
          f"256 entries acknowledged each): median {statistics.median(costs) * 1e3:.2f} ms, "
          f"max {max(costs) * 1e3:.2f} ms")
    out["offset commit median ms"] = statistics.median(costs) * 1e3
    return out


if __name__ == "__main__":
    main()
