"""Per-operation costs at scale, on single Redis and on a Redis Cluster: the measured
inputs of ``docs/SCALING.md``.

Starts its own redis-server and its own Redis Cluster (3 masters + 3 replicas: the
``tests/servers.py`` fixtures) and on each, with P partitions of E records:

1. ingest: the file ``Producer`` appends P x E records of ``--record-bytes`` from an
   npy source. Producer CPU per MB (this process's CPU time; and of it, reading and
   planning the source, which every producer of a dataset repeats), redis-server CPU per MB
   (masters; the replicas' apart), and Redis memory per entry (``MEMORY USAGE`` of the
   streams, and the ``used_memory`` delta of the masters).
2. group: a ``TrainingSession``'s first restore of a new run creates its consumer
   group, fence and seek on every partition: the memory that adds, per partition.
3. read + commit: the session (one process owning every partition, so its checkpoint
   does rank 0's whole commit work of any world size) reads greedily through
   ``StreamingDataset``, P records per round (with P >= 4 batches: one record of
   every partition, a single read), and checkpoints after each round: the
   checkpoint's wall and CPU time, the loop's stall, the part spent acknowledging
   and publishing offsets (per partition), one rank's fence check, the session
   record's bytes per partition and per rank, and the partitions per read (from
   ``INFO commandstats`` and the reader's count of reads; a read is one round trip,
   every server's XREADGROUPs written before any reply is read).
   Then deep reads, greedy and deterministic: ``StreamingDataset`` reading a few long
   partitions to their end (many entries per XREADGROUP, as a worker owning one
   partition or a few does): redis-server and reader CPU per MB, and the memory of
   the entries left pending (read, not acknowledged: what a group holds between
   checkpoints).
4. ranks: W ranks simulated in this process with the real trainer_client calls, one
   rank after another. A commit on a rank other than 0 is its fence check of all P
   partitions and its share of the all-gather of offsets (its pickled payload; each
   rank unpickles and merges W of them, measured through ``gather_offsets`` itself); a
   restore on such a rank loads the manifest, records the seek of its partitions and
   starts each worker's pass. Rank 0's restore is a new session's real restore.
   Composed (ranks run in parallel on their own hosts; the Redis work of all W lands
   on the same servers, so their CPU is summed)::

       commit  = rank 0's checkpoint (until published) + the W-payload gather
                 + max(0, server CPU of W fence checks per master - one fence check)
       stall   = the same with rank 0's checkpoint call (until it returns) instead
       restore = rank 0's restore + the slowest other rank's restart (its manifest
                 load runs beside rank 0's)

Prints a table of medians with their range over rounds and merges a ``scale`` section
into the JSON results file (``bench/rounds.py``). This machine has 2 cores shared with
other work: read per-op costs, not throughput, and mind the ranges.

    .venv/bin/python bench/scale.py --per-op              # 4,096 partitions, 64 ranks
    .venv/bin/python bench/scale.py --per-op --partitions 256 --ranks 8 --no-cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import rounds as rd  # noqa: E402

from ingest_service import redis_client as async_redis  # noqa: E402
from ingest_service.datasets import create_dataset  # noqa: E402
from ingest_service.producer.producer import Producer  # noqa: E402
from ingest_service.sources.planner import plan_spec_chunks  # noqa: E402
from tests.servers import RedisCluster, RedisServer  # noqa: E402
from trainer_client import (  # noqa: E402
    StreamingDataset,
    TrainingSession,
    _rng,
    redis_client,
)
from trainer_client import offsets as ofs  # noqa: E402
from trainer_client._commit import gather_offsets  # noqa: E402
from trainer_client._reader import Reader  # noqa: E402
from trainguard.core import streams  # noqa: E402
from trainguard.core.checkpoints import open_store, rank_state_store  # noqa: E402
from trainguard.core.record import RankState  # noqa: E402

DATASET = "scale"
DEEP = "deep"
MEMORY_SAMPLE = 64
"""Partitions whose keys ``MEMORY USAGE`` weighs (exact per key; every key would cost
a round trip each)."""


def spread(values: list[float], digits: int = 6) -> dict[str, float]:
    """Median and range of a measure over its repeats."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "n": len(values)}


# ------------------------------------------------------------------ the servers
class Target:
    """One Redis (a server or a cluster) and what its servers report."""

    def __init__(self, name: str, server: RedisServer | RedisCluster):
        self.name, self.server = name, server
        self.url = server.url

    def _nodes(self, role: str) -> list[RedisServer]:
        if isinstance(self.server, RedisServer):
            return [self.server] if role == "master" else []
        out: list[RedisServer] = []
        for node in self.server.nodes:
            c = redis.Redis(port=node.port)
            try:
                if (c.execute_command("ROLE")[0] in (b"master", "master")) == (role == "master"):
                    out.append(node)
            finally:
                c.close()
        return out

    def cpu_s(self, role: str = "master") -> float:
        """CPU seconds the ``role`` nodes used so far (summed)."""
        return sum(rd.process_cpu_s(n.pid) for n in self._nodes(role) if n.pid)

    def info(self, section: str) -> list[dict[str, Any]]:
        out = []
        for node in self._nodes("master"):
            c = redis.Redis(port=node.port)
            try:
                out.append(c.info(section))
            finally:
                c.close()
        return out

    def used_memory(self) -> int:
        return sum(int(i["used_memory"]) for i in self.info("memory"))

    def calls(self) -> dict[str, int]:
        """Calls per command, summed over the masters."""
        out: dict[str, int] = {}
        for stats in self.info("commandstats"):
            for k, v in stats.items():
                out[k.removeprefix("cmdstat_")] = out.get(k.removeprefix("cmdstat_"), 0) + int(v["calls"])
        return out

    def stop(self) -> None:
        if isinstance(self.server, RedisCluster):
            self.server.stop()
        else:
            self.server.kill()


def key_bytes(client: redis.Redis, keys: list[str]) -> int:
    """``MEMORY USAGE`` of ``keys`` (every element counted), summed; missing keys 0."""
    return sum(int(client.memory_usage(k, samples=0) or 0) for k in keys)


class Reads:
    """Counts the reads this process's readers send around a block: each is one round
    trip (the XREADGROUPs of every server it touches written before any reply is
    read), whether a read returns its replies at once or sent them ahead of the next."""

    def __enter__(self) -> Reads:
        self.n, self._send = 0, Reader._send

        def counted(reader: Reader, counts: dict[int, int]) -> Any:
            self.n += 1
            return self._send(reader, counts)

        Reader._send = counted  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Reader._send = self._send  # type: ignore[method-assign]


class Clock:
    """Wall seconds, this process's CPU and the servers' CPU around a block."""

    def __init__(self, target: Target):
        self.target = target

    def __enter__(self) -> Clock:
        self.server0, self.cpu0 = self.target.cpu_s(), time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.t0
        self.cpu_s = time.process_time() - self.cpu0
        self.server_cpu_s = self.target.cpu_s() - self.server0


# ------------------------------------------------------------------ the measures
async def _produce(url: str, spec: streams.DatasetSpec) -> int:
    client = async_redis.client(url)
    try:
        await create_dataset(client, spec)
        producer = Producer(client, spec)
        await producer.run()
        return producer.progress.records
    finally:
        await client.aclose()


def ingest(t: Target, work: Path, name: str, partitions: int, entries: int,
           record_bytes: int) -> dict[str, Any]:
    records = partitions * entries
    source = work / f"{name}.npy"
    np.save(source, np.random.default_rng(0).integers(0, 255, records * record_bytes,
                                                      dtype=np.uint8))
    spec = streams.DatasetSpec(name=name, partitions=partitions, source=str(source),
                               format="npy", sample_len=record_bytes)
    mem0, replica0 = t.used_memory(), t.cpu_s("replica")
    with Clock(t) as c:
        appended = asyncio.run(_produce(t.url, spec))
    replica_cpu = t.cpu_s("replica") - replica0
    mb = records * record_bytes / 1e6
    # What every producer of a dataset repeats whatever its share of the partitions
    # (leases split the writing, not the reading and planning of the source).
    c0 = time.process_time()
    for chunk in plan_spec_chunks(spec, 0):
        for _ in chunk.by_partition(partitions):
            pass
    plan_cpu = time.process_time() - c0
    client = redis_client.client(t.url)
    try:
        sample = [streams.partition_key(name, p) for p in range(min(MEMORY_SAMPLE, partitions))]
        sampled = sum(int(client.xlen(k)) for k in sample)
        per_entry = key_bytes(client, sample) / sampled
    finally:
        client.close()
    return {
        "records": appended, "mb": round(mb, 3), "wall_s": round(c.wall_s, 4),
        "producer_cpu_s_per_mb": round(c.cpu_s / mb, 6),
        "plan_cpu_s_per_mb": round(plan_cpu / mb, 6),
        "server_cpu_s_per_mb": round(c.server_cpu_s / mb, 6),
        "replica_cpu_s_per_mb": round(replica_cpu / mb, 6),
        "memory_usage_bytes_per_entry": round(per_entry, 1),
        "used_memory_bytes_per_entry": round((t.used_memory() - mem0) / records, 1),
    }


def deep_read(t: Target, args: argparse.Namespace, *, deterministic: bool) -> dict[str, Any]:
    """A StreamingDataset reading ``--deep-partitions`` long partitions to their end: many
    entries per XREADGROUP, as when a worker owns one partition or a few (the projected
    shape) rather than thousands with a record each. Greedy reads ask every partition
    in each read; deterministic ones ask, in one round trip, every partition whose next
    records are not read ahead yet, a batch of each (see docs/guides/batches.md)."""
    client = redis_client.client(t.url)
    keys = [streams.partition_key(DEEP, p) for p in range(args.deep_partitions)]
    mem0, calls0 = key_bytes(client, keys), t.calls()
    with Clock(t) as c, Reads() as reads:
        ds = StreamingDataset(t.url, DEEP, f"deep-{deterministic:d}", batch_size=args.batch,
                              deterministic=deterministic)
        records = sum(len(b) for b in ds)
    calls = {k: v - calls0.get(k, 0) for k, v in t.calls().items()}
    # Nothing acknowledges here (no session): every entry read is pending in the group.
    pending = (key_bytes(client, keys) - mem0) / records
    client.close()
    mb = records * args.record_bytes / 1e6
    return {
        "pending_bytes_per_entry": round(pending, 1),
        "records": records, "mb_s": round(mb / c.wall_s, 2),
        "client_cpu_s_per_mb": round(c.cpu_s / mb, 6),
        "server_cpu_s_per_mb": round(c.server_cpu_s / mb, 6),
        "entries_per_xreadgroup": round(records / max(1, calls.get("xreadgroup", 0)), 1),
        "partitions_per_read": round(calls.get("xreadgroup", 0) / max(1, reads.n), 2),
    }


def group_keys(p: int, run: str) -> list[str]:
    return [streams.partition_key(DATASET, p), streams.fence_key(DATASET, p, run),
            streams.seek_key(DATASET, p, run)]


def read_commit(t: Target, args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], Any]:
    """Group memory, then reading and committing; returns the figures and the store URL."""
    store = (work / "ckpt").as_uri()
    run = "scale"
    client = redis_client.client(t.url)
    sample = range(min(MEMORY_SAMPLE, args.partitions))
    before = sum(key_bytes(client, group_keys(p, run)) for p in sample)
    mem0 = t.used_memory()
    # Greedy: each read asks every partition (deterministic reads ask those whose next
    # records are not read ahead: see the deep reads).
    session = TrainingSession(t.url, dataset=DATASET, run=run, store=store, keep_last=2,
                              deterministic=False)
    state = {"model": torch.nn.Linear(8, 8)}
    with Clock(t) as fresh:
        session.restore(state)
    group = {
        "memory_usage_bytes_per_partition": round(
            (sum(key_bytes(client, group_keys(p, run)) for p in sample) - before) / len(sample), 1),
        "used_memory_bytes_per_partition": round((t.used_memory() - mem0) / args.partitions, 1),
        "first_restore_s": round(fresh.wall_s, 4),
    }
    batch = min(args.batch, args.partitions)
    per_round = args.partitions // batch
    it: Iterator[Any] = iter(session.batches(session.dataset(batch_size=batch)))
    read_s, read_cpu, records = 0.0, 0.0, 0
    stall: list[float] = []
    ckpt: list[float] = []
    ckpt_cpu: list[float] = []
    publish: list[float] = []
    server: list[float] = []
    calls: dict[str, int] = {}
    reads = 0
    for step in range(1, args.rounds + 1):
        # Only the reads count: a checkpoint's publish is a transaction too.
        calls0, cpu0, t0 = t.calls(), t.cpu_s(), time.perf_counter()
        with Reads() as counted:
            for _ in range(per_round):
                records += len(next(it))
        reads += counted.n
        read_s += time.perf_counter() - t0
        read_cpu += t.cpu_s() - cpu0
        for k, v in t.calls().items():
            calls[k] = calls.get(k, 0) + v - calls0.get(k, 0)
        with Clock(t) as c:
            t0 = time.perf_counter()
            session.checkpoint(state, step)  # returns once staged: the loop's stall
            stall.append(time.perf_counter() - t0)
            session.wait()  # committed, acknowledged, published
        ckpt.append(c.wall_s)
        ckpt_cpu.append(c.cpu_s)
        server.append(c.server_cpu_s)
        assert session.last_commit_offsets_s is not None
        publish.append(session.last_commit_offsets_s)
    fence, fence_cpu = [], []
    for _ in range(args.rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        ofs.current_generations(client, DATASET, run, args.partitions)
        fence.append(time.perf_counter() - t0)
        fence_cpu.append(time.process_time() - c0)
    offsets, batches = session.offsets, dict.fromkeys(range(args.partitions), 1)
    session.close()
    client.close()
    manifest = max((work / "ckpt" / "manifests").glob("*.json"), key=lambda f: f.stat().st_mtime)
    doc = json.loads(manifest.read_text())
    record = doc["extra"]["trainguard"]
    # Session record version 3: the manifest indexes each rank's state object (its
    # partitions' offsets and batch counts, its random states and position).
    reader = rank_state_store(open_store(store))
    assert reader is not None, "a CheckpointStore keeps per-rank state objects"
    newest = reader.latest()
    assert newest is not None and newest.name == manifest.name
    own = reader.read_rank_state(newest, 0) or {}
    reader.close()
    rank_state = len(json.dumps(own, separators=(",", ":")))
    rec = json.dumps(record, separators=(",", ":"))
    committed = own.get("offsets", {})
    P = args.partitions
    figures = {
        "group": group,
        "read": {
            "records": records, "mb_s": round(records * args.record_bytes / 1e6 / read_s, 2),
            "server_cpu_s_per_mb": round(read_cpu / (records * args.record_bytes / 1e6), 6),
            "reads": reads, "xreadgroup": calls.get("xreadgroup", 0),
            "partitions_per_read": round(calls.get("xreadgroup", 0) / max(1, reads), 2),
        },
        "commit": {
            "checkpoint_s": spread(ckpt), "stall_s": spread(stall), "publish_s": spread(publish),
            "publish_us_per_partition": spread([s / P * 1e6 for s in publish], 3),
            "server_cpu_s": spread(server), "fence_check_s": spread(fence),
            "checkpoint_cpu_s": spread(ckpt_cpu), "fence_check_cpu_s": spread(fence_cpu),
            "manifest_bytes": manifest.stat().st_size,
            "record_bytes_per_partition": round(len(rec) / P, 1),
            "rank_state_bytes": rank_state,
            "offsets_in_manifest": len(record.get("offsets", {})),
            "offsets_in_rank_state": len(committed),
            "partitions_committed": sum(i != streams.ZERO_ID for i in committed.values()),
        },
    }
    return figures, (store, offsets, batches)


def gather_cost(offsets: dict[int, str], batches: dict[int, int], mine: RankState,
                world: int) -> tuple[float, float]:
    """Wall and CPU seconds one rank spends on the all-gather's objects of ``world``
    ranks: pickling its own and unpickling and merging every rank's, through
    ``gather_offsets`` on a one-rank gloo group (the transport of the bytes is not in
    it)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(world):
            gather_offsets(offsets, batches, mine, 1, None)
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        dist.destroy_process_group()


def ranks(t: Target, args: argparse.Namespace, carried: Any) -> dict[str, Any]:
    store, offsets, batches = carried
    run, P, W = "scale", args.partitions, args.ranks
    client = redis_client.client(t.url)
    state = {"model": torch.nn.Linear(8, 8)}
    rank0, gens = [], []
    for _ in range(args.restores):
        session = TrainingSession(t.url, dataset=DATASET, run=run, store=store, keep_last=2,
                                  deterministic=False)
        t0 = time.perf_counter()
        session.restore(state)
        rank0.append(time.perf_counter() - t0)
        assert session.generation is not None  # restore took one
        gens.append(session.generation)
        session.close()
    gen = gens[-1]
    loads = []
    for _ in range(args.restores):
        other = open_store(store)
        t0 = time.perf_counter()
        other.load(state)
        loads.append(time.perf_counter() - t0)
        other.close()

    def timed_ranks(fn: Callable[[int], object]) -> tuple[list[float], float]:
        walls, cpu0 = [], t.cpu_s()
        for r in range(W):
            t0 = time.perf_counter()
            fn(r)
            walls.append(time.perf_counter() - t0)
        return walls, t.cpu_s() - cpu0

    def restart(r: int) -> None:
        owned = {w: streams.assign_partitions(P, world_size=W, num_workers=args.workers,
                                              rank=r, worker=w) for w in range(args.workers)}
        mine = sorted(p for ps in owned.values() for p in ps)
        ofs.write_seek(client, DATASET, run, gen, {p: offsets[p] for p in mine},
                       {p: batches[p] for p in mine})
        for ps in owned.values():
            if ps:
                ofs.start_pass(client, DATASET, run, gen, ps, use_seek=True)

    restarts, restart_cpu = timed_ranks(restart)
    fences, fence_cpu = timed_ranks(lambda r: ofs.current_generations(client, DATASET, run, P))
    client.close()
    # What a rank contributes: its offsets and batch counts of every partition and its
    # random states (as TrainingSession.checkpoint gathers them).
    mine = RankState(rng=_rng.capture())
    payload = len(pickle.dumps((offsets, batches, mine.to_wire())))
    gather = [gather_cost(offsets, batches, mine, W) for _ in range(args.rounds)]
    masters = len(t.info("server"))
    return {
        "world_size": W, "workers": args.workers,
        "rank0_restore_s": spread(rank0), "manifest_load_s": spread(loads),
        "rank_restart_s": spread(restarts), "restart_server_cpu_s": round(restart_cpu, 5),
        "rank_fence_check_s": spread(fences), "fence_checks_server_cpu_s": round(fence_cpu, 5),
        "gather_payload_bytes": payload, "gather_bytes_per_rank": payload * W,
        "gather_objects_s": spread([g[0] for g in gather]),
        "gather_objects_cpu_s": spread([g[1] for g in gather]), "masters": masters,
        "generations_taken": len(set(gens)),
    }


def compose(fig: dict[str, Any]) -> dict[str, float]:
    """Commit latency and restore time at W ranks from the measured parts (medians)."""
    c, r = fig["commit"], fig["ranks"]
    queue = max(0.0, r["fence_checks_server_cpu_s"] / r["masters"] - c["fence_check_s"]["median"])
    added = r["gather_objects_s"]["median"] + queue
    return {
        "commit_s": round(c["checkpoint_s"]["median"] + added, 4),
        "stall_s": round(c["stall_s"]["median"] + added, 4),
        # Every rank loads the manifest while rank 0 does (inside its restore).
        "restore_s": round(r["rank0_restore_s"]["median"] + r["rank_restart_s"]["max"], 4),
        "fence_queue_s": round(queue, 5),
    }


def measure(t: Target, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    fig: dict[str, Any] = {
        "ingest": ingest(t, work, DATASET, args.partitions, args.entries, args.record_bytes),
        "deep_ingest": ingest(t, work, DEEP, args.deep_partitions, args.deep_entries,
                              args.record_bytes),
    }
    fig["deep_read"] = deep_read(t, args, deterministic=False)
    fig["deep_read_deterministic"] = deep_read(t, args, deterministic=True)
    rc, carried = read_commit(t, args, work)
    fig.update(rc)
    fig["ranks"] = ranks(t, args, carried)
    fig["at_world"] = compose(fig)
    return fig


# ------------------------------------------------------------------ output
def _s(d: dict[str, float], scale: float = 1e3, unit: str = "ms") -> str:
    return (f"{d['median'] * scale:.2f} {unit} ({d['min'] * scale:.2f}-"
            f"{d['max'] * scale:.2f})")


def print_table(figures: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.partitions} partitions x {args.entries} records of {args.record_bytes} B, "
          f"{args.ranks} ranks x {args.workers} workers; median (range over repeats)")
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("producer CPU s/MB", lambda f: f"{f['ingest']['producer_cpu_s_per_mb']:.4f}"),
        ("  of it reading + planning the source", lambda f: f"{f['ingest']['plan_cpu_s_per_mb']:.4f}"),
        ("redis-server CPU s/MB ingested (masters)", lambda f: f"{f['ingest']['server_cpu_s_per_mb']:.4f}"),
        ("replica CPU s/MB ingested", lambda f: f"{f['ingest']['replica_cpu_s_per_mb']:.4f}"),
        ("memory per entry, MEMORY USAGE B", lambda f: f"{f['ingest']['memory_usage_bytes_per_entry']:.0f}"),
        ("memory per entry, used_memory B", lambda f: f"{f['ingest']['used_memory_bytes_per_entry']:.0f}"),
        ("memory per group per partition B", lambda f: f"{f['group']['memory_usage_bytes_per_partition']:.0f}"),
        ("partitions per read (one round trip)", lambda f: f"{f['read']['partitions_per_read']:.1f}"),
        ("redis-server CPU s/MB read (masters)", lambda f: f"{f['read']['server_cpu_s_per_mb']:.4f}"),
        ("memory per pending (unacked) entry B", lambda f: f"{f['deep_read']['pending_bytes_per_entry']:.0f}"),
        ("deep read: entries per XREADGROUP", lambda f: f"{f['deep_read']['entries_per_xreadgroup']:.1f}"),
        ("  redis-server CPU s/MB read", lambda f: f"{f['deep_read']['server_cpu_s_per_mb']:.4f}"),
        ("  reader CPU s/MB", lambda f: f"{f['deep_read']['client_cpu_s_per_mb']:.4f}"),
        ("deterministic deep read: partitions/read",
         lambda f: f"{f['deep_read_deterministic']['partitions_per_read']:.1f}"),
        ("  redis-server CPU s/MB read",
         lambda f: f"{f['deep_read_deterministic']['server_cpu_s_per_mb']:.4f}"),
        ("  producer CPU s/MB (deep)", lambda f: f"{f['deep_ingest']['producer_cpu_s_per_mb']:.4f}"),
        ("checkpoint (rank 0, all P)", lambda f: _s(f["commit"]["checkpoint_s"])),
        ("  its CPU time (all threads)", lambda f: _s(f["commit"]["checkpoint_cpu_s"])),
        ("  of it the call (loop stalls)", lambda f: _s(f["commit"]["stall_s"])),
        ("  of it ack + publish", lambda f: _s(f["commit"]["publish_s"])),
        ("  per partition", lambda f: _s(f["commit"]["publish_us_per_partition"], 1, "us")),
        ("fence check, one rank", lambda f: _s(f["commit"]["fence_check_s"])),
        ("  its CPU time", lambda f: _s(f["commit"]["fence_check_cpu_s"])),
        ("manifest bytes (record B/partition)", lambda f: f"{f['commit']['manifest_bytes']} "
         f"({f['commit']['record_bytes_per_partition']:.1f})"),
        ("  rank state object B (offsets, random states)",
         lambda f: f"{f['commit']['rank_state_bytes']}"),
        ("gather objects, W payloads", lambda f: _s(f["ranks"]["gather_objects_s"])),
        ("  its CPU time", lambda f: _s(f["ranks"]["gather_objects_cpu_s"])),
        ("gather bytes received per rank", lambda f: f"{f['ranks']['gather_bytes_per_rank']:,}"),
        ("server CPU, W fence checks s", lambda f: f"{f['ranks']['fence_checks_server_cpu_s']:.3f}"),
        ("rank 0 restore", lambda f: _s(f["ranks"]["rank0_restore_s"])),
        ("other rank restart", lambda f: _s(f["ranks"]["rank_restart_s"])),
        ("=> commit latency at W ranks", lambda f: f"{f['at_world']['commit_s'] * 1e3:.1f} ms"),
        ("=> loop stall of a commit at W ranks", lambda f: f"{f['at_world']['stall_s'] * 1e3:.1f} ms"),
        ("=> restore time at W ranks", lambda f: f"{f['at_world']['restore_s'] * 1e3:.1f} ms"),
    ]
    names = list(figures)
    print(f"{'':42s}" + "".join(f"{n:>30s}" for n in names))
    for label, cell in rows:
        print(f"{label:42s}" + "".join(f"{cell(figures[n]):>30s}" for n in names))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, default=4096)
    ap.add_argument("--entries", type=int, default=8, help="records per partition")
    ap.add_argument("--record-bytes", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=64, help="simulated world size")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--deep-partitions", type=int, default=16,
                    help="partitions of the deep-read dataset")
    ap.add_argument("--deep-entries", type=int, default=512,
                    help="records per partition of the deep-read dataset")
    ap.add_argument("--rounds", type=int, default=5, help="checkpoints (and gather repeats)")
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--no-cluster", action="store_true", help="single Redis only")
    ap.add_argument("--out", help="results file (default: bench/results/<host>-<stamp>.json)")
    args = ap.parse_args(argv)
    if args.rounds > args.entries:
        ap.error(f"--rounds {args.rounds} reads one record per partition per round: "
                 f"needs --entries >= {args.rounds}")
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tg-bench-scale-") as tmp:
        made: list[tuple[str, Callable[[], RedisServer | RedisCluster]]] = [
            ("single", lambda: RedisServer(Path(tmp) / "redis").start())]
        if not args.no_cluster:
            made.append(("cluster", lambda: RedisCluster(Path(tmp) / "cluster").start()))
        for name, start in made:
            target = Target(name, start())
            try:
                work = Path(tmp) / f"work-{name}"
                work.mkdir()
                figures[name] = measure(target, args, work)
            finally:
                target.stop()
    print_table(figures, args)
    section = {"args": vars(args) | {"out": None}, "targets": figures}
    out = Path(args.out) if args.out else rd.results_path()
    rd.write_section(out, "scale", section, rd.machine())
    print(f"\nwrote the scale section of {out}")
    return section


if __name__ == "__main__":
    main()
