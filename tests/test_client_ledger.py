"""The ledger test: a training job SIGKILLed at random moments (during steps, during
async checkpoint writes, right after a commit) and restarted until its finite dataset
is consumed ends with every record counted exactly once: 0 lost, 0 duplicated."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisCluster, RedisServer
from trainer_client import redis_client
from trainguard.core import streams

N = 3000
P = 6


def _args(url: str, store: str, *extra: str) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "exp", "--store", store,
            "--n", str(N), "--batch-size", "8", "--ckpt-every", "8", "--sleep-ms", "2", *extra]


def _check(url: str, store: str) -> None:
    counts, extra = ledger.final_counts(store, N)
    lost = int((counts == 0).sum())
    dup = int((counts > 1).sum())
    assert (lost, dup) == (0, 0), f"{lost} records lost, {dup} trained more than once"
    assert torch.equal(counts, torch.ones(N))
    # the final manifest's offsets are each partition's last ID, and Redis agrees
    client = redis_client.client(url)
    progress = client.hgetall(streams.progress_key("tok"))
    ends = {p: progress[streams.progress_end_field(p)].decode() for p in range(P)}
    assert streams.offsets_from_wire(extra["trainguard"]["offsets"]) == ends
    assert streams.offsets_from_wire(client.hgetall(streams.committed_key("tok", "exp"))) == ends
    for p in range(P):
        assert client.xpending(streams.partition_key("tok", p), "exp")["pending"] == 0


def test_ledger_survives_20_kills(redis_server, tmp_path: Path) -> None:
    """20 SIGKILLs of a one-process job (num_workers=0): every record counted once."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    kills = ledger.run_until_done(_args(redis_server.url, store), kills=20, seed=1,
                                  log=tmp_path / "job.log")
    assert kills == 20
    _check(redis_server.url, store)


def test_ledger_two_workers(redis_server, tmp_path: Path) -> None:
    """num_workers=2 (persistent), 10 SIGKILLs: every record counted once."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    kills = ledger.run_until_done(_args(redis_server.url, store, "--workers", "2"), kills=10,
                                  seed=3, log=tmp_path / "job.log")
    assert kills == 10
    _check(redis_server.url, store)


def test_ledger_world_size_2_then_1(redis_server, tmp_path: Path) -> None:
    """Two ranks (gloo) killed three times, then restarts on one rank (killed once
    more): partitions are reassigned and every record is still counted once."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    kills = ledger.run_until_done(
        _args(redis_server.url, store), kills=4, seed=4, log=tmp_path / "job.log",
        world_for=lambda attempt: 2 if attempt < 3 else 1,
    )
    assert kills == 4
    _check(redis_server.url, store)


def test_ledger_two_ranks_with_two_workers_each_then_one(redis_server, tmp_path: Path) -> None:
    """DDP with DataLoader workers: two ranks (gloo) of 2 workers each killed three
    times, then one rank of 2 workers: the batches every worker of every rank read
    ahead but did not train are not committed, and every record is counted once: 0
    lost, 0 duplicated."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    kills = ledger.run_until_done(
        _args(redis_server.url, store, "--workers", "2"), kills=4, seed=6,
        log=tmp_path / "job.log", world_for=lambda attempt: 2 if attempt < 3 else 1,
    )
    assert kills == 4
    _check(redis_server.url, store)


def test_ledger_world_size_4_then_3_then_5(redis_server, tmp_path: Path) -> None:
    """Four ranks killed twice, then three ranks killed twice, then five: each restart
    reads, per rank, the state objects of the ranks that owned its new partitions
    (their owners change at each step) and every record is still counted exactly
    once: 0 lost, 0 duplicated."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/ckpt"
    worlds = [4, 4, 3, 3, 5]
    kills = ledger.run_until_done(
        _args(redis_server.url, store), kills=4, seed=5, log=tmp_path / "job.log",
        world_for=lambda attempt: worlds[min(attempt, len(worlds) - 1)],
    )
    assert kills == 4
    _check(redis_server.url, store)


def test_ledger_redis_killed_with_aof_everysec(redis_factory, tmp_path: Path) -> None:
    """Redis (AOF, appendfsync everysec) is SIGKILLed and restarted under a training
    job, and between killed jobs; the trainer reconnects, the restarted Redis may have
    lost its last second (acks, group moves, fences): every record counted once."""
    server = redis_factory(persistence="everysec")
    spec = cf.create(server.url, "tok", partitions=P)
    cf.fill(server.url, spec, N)
    time.sleep(1.5)  # the dataset itself is on disk; what follows may be lost
    store = f"file://{tmp_path}/ckpt"
    rng = random.Random(5)

    def during(attempt: int, job: ledger.Job) -> None:
        if attempt % 2 == 1:
            job.sleep(rng.uniform(0.0, 0.3))
            server.restart()

    kills = ledger.run_until_done(
        _args(server.url, store), kills=8, seed=6, log=tmp_path / "job.log",
        during=during, between=lambda attempt: server.restart() if attempt % 3 == 0 else None,
    )
    assert kills == 8
    _check(server.url, store)


def _cluster_ledger(cluster: RedisCluster, tmp_path: Path, *, kills: int, seed: int,
                    workers: int, world_for: Callable[[int], int] = lambda attempt: 1) -> None:
    """Trainer kills on a Redis Cluster, and in the second attempt a kill -9 of the
    master of partition 0 (its replica promoted; replication is asynchronous, so
    the acks, group moves and fences it had not passed on are lost)."""
    spec = cf.create(cluster.url, "tok", partitions=P)
    cf.fill(cluster.url, spec, N)
    cluster.wait_replicated()  # the dataset itself is on the replicas
    store = f"file://{tmp_path}/ckpt"
    rng = random.Random(seed)
    killed: list[int] = []

    def during(attempt: int, job: ledger.Job) -> None:
        if attempt == 1:
            job.sleep(rng.uniform(0.0, 0.5))
            killed.append(cluster.kill_master(streams.partition_key("tok", 0)).port)

    got = ledger.run_until_done(_args(cluster.url, store, "--workers", str(workers)), kills=kills,
                                seed=seed, log=tmp_path / "job.log", during=during,
                                world_for=world_for)
    assert got == kills
    assert len(killed) == 1
    _check(cluster.url, store)


def test_ledger_cluster_master_killed(redis_cluster_factory, tmp_path: Path) -> None:
    """On a Redis Cluster, DataLoader workers (2), 4 trainer SIGKILLs and one master
    SIGKILL mid-run: every record counted once."""
    _cluster_ledger(redis_cluster_factory(), tmp_path, kills=4, seed=11, workers=2)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(20))
def test_ledger_cluster_master_killed_20_seeds(redis_cluster_factory, tmp_path: Path,
                                               seed: int) -> None:
    """The same, 20 times, with random kill points and 0 or 2 workers."""
    _cluster_ledger(redis_cluster_factory(), tmp_path, kills=6, seed=100 + seed,
                    workers=2 * (seed % 2))


@pytest.mark.chaos
def test_ledger_cluster_world_size_2_then_1(redis_cluster_factory, tmp_path: Path) -> None:
    """Elastic on a cluster: two ranks (gloo) through the master kill, then one rank;
    every record counted once."""
    _cluster_ledger(redis_cluster_factory(), tmp_path, kills=4, seed=21, workers=0,
                    world_for=lambda attempt: 2 if attempt < 3 else 1)


def _commit_kill_ledger(cluster: RedisCluster, tmp_path: Path, *, seed: int, kills: int,
                        workers: int) -> None:
    """Trainer kills on a Redis Cluster and, in every attempt, a kill -9 of a master
    while a commit is in flight: just after rank 0's SAVE line (the fence check done,
    the async save and then its acknowledgements and publications under way), the
    master of a random partition is killed; on odd attempts its replication is cut at
    the SAVE line first, so that the commit's acks, committed offsets and retention
    floor, written to that master, are surely lost with it. The victim rejoins as a
    replica after the trainer kill, so that every failover has a replica to promote."""
    spec = cf.create(cluster.url, "tok", partitions=P)
    cf.fill(cluster.url, spec, N)
    cluster.wait_replicated()  # the dataset itself is on the replicas
    store = f"file://{tmp_path}/ckpt"
    rng = random.Random(seed)
    killed: list[tuple[int, int]] = []  # (attempt, partition whose master was killed)
    victims: list[RedisServer] = []

    def during(attempt: int, job: ledger.Job) -> None:
        if not job.wait_line("SAVE", 120, nth=rng.randint(1, 2)):
            return  # the job finished first
        part = rng.randrange(P)
        key = streams.partition_key("tok", part)
        if attempt % 2 == 1:
            cluster.cut_replication(key)
        job.sleep(rng.uniform(0.0, 0.02))
        victims.append(cluster.kill_master(key))
        killed.append((attempt, part))

    def between(attempt: int) -> None:
        while victims:
            victims.pop().restart()  # back as a replica of the promoted one
        cluster.wait_healthy()

    # 10 ms steps: the job must still be training after a failover's second
    args = _args(cluster.url, store, "--workers", str(workers))
    args[args.index("--sleep-ms") + 1] = "10"
    got = ledger.run_until_done(args, kills=kills, seed=seed, log=tmp_path / "job.log",
                                during=during, between=between)
    assert got == kills
    # every killed attempt saw its master kill mid-commit (the last one may finish first)
    assert [a for a, _ in killed][:kills] == list(range(kills)), killed
    _check(cluster.url, store)


def test_ledger_cluster_master_killed_during_commits(redis_cluster_factory,
                                                     tmp_path: Path) -> None:
    """On a Redis Cluster, a master kill -9 during each of 4 commits (two of them with
    the master's replication cut, so what the commit wrote there is lost), and the
    trainer killed after each: every record trained exactly once, 0 lost, 0 duplicated,
    and Redis's committed offsets are each partition's last ID."""
    _commit_kill_ledger(redis_cluster_factory(), tmp_path, seed=41, kills=4, workers=0)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(10))
def test_ledger_cluster_master_killed_during_commits_10_seeds(
        redis_cluster_factory, tmp_path: Path, seed: int) -> None:
    """The same, 10 times, with random kill points and 0 or 2 workers."""
    _commit_kill_ledger(redis_cluster_factory(), tmp_path, seed=400 + seed, kills=6,
                        workers=2 * (seed % 2))


def _producer_ledger(url: str, tmp_path: Path, *, seed: int, kills: int,
                     take_over: bool) -> None:
    """The real ingest producer (backlog bound 150 entries per partition, so it keeps
    pausing for the trainer's commits) is SIGKILLed while trainers are killed too.
    Without ``take_over`` it is restarted each time; with it, two producers share the
    partitions (leases of 600 ms) and the first is killed once, for good: the second
    takes its partitions over. Every record is counted once."""
    source = tmp_path / "tokens.npy"
    np.save(source, np.repeat(np.arange(N, dtype=np.int64), 8))
    cmd = [sys.executable, str(ledger.ROOT / "tests" / "_client_produce.py"), url,
           "tok", str(source), str(P), "150", "600"]
    env = {**os.environ, "PYTHONPATH": str(ledger.ROOT)}
    procs: list[subprocess.Popen[bytes]] = []

    def start_producer() -> None:
        with open(tmp_path / f"producer-{len(procs)}.log", "ab") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))

    rng = random.Random(seed)

    def during(attempt: int, job: ledger.Job) -> None:
        if take_over:
            if attempt == 0:
                job.sleep(rng.uniform(0.0, 0.5))
                procs[0].kill()
                procs[0].wait()
        elif attempt % 2 == 0 and procs[-1].poll() is None:
            job.sleep(rng.uniform(0.0, 0.3))
            procs[-1].kill()
            procs[-1].wait()
            start_producer()

    client = redis_client.client(url)
    for _ in range(2 if take_over else 1):
        start_producer()
    try:
        deadline = time.monotonic() + 60
        while not client.exists(streams.meta_key("tok")):
            assert time.monotonic() < deadline and procs[-1].poll() is None, \
                "producer did not create the dataset"
            time.sleep(0.05)
        store = f"file://{tmp_path}/ckpt"
        got = ledger.run_until_done(_args(url, store), kills=kills, seed=seed,
                                    log=tmp_path / "job.log", during=during)
        assert got == kills
        assert procs[-1].wait(60) == 0
        if take_over:
            assert procs[0].returncode == -9
            first = (tmp_path / "producer-0.log").read_text()
            second = (tmp_path / "producer-1.log").read_text()
            assert "writes partitions [" in first  # it held a share when it was killed
            assert f"writes partitions {list(range(P))}" in second  # and the rest took it
        else:
            assert len(procs) > 1  # it really was killed and restarted
        _check(url, store)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_ledger_producer_killed_too(redis_server, tmp_path: Path) -> None:
    """One producer, SIGKILLed and restarted while trainers are killed: it resumes
    from the partitions' last IDs, the trainer from its checkpoint; each record once."""
    _producer_ledger(redis_server.url, tmp_path, seed=8, kills=8, take_over=False)


def test_ledger_cluster_producer_taken_over(redis_cluster, tmp_path: Path) -> None:
    """On a Redis Cluster, two ingest producers share the partitions; one is SIGKILLed
    for good while trainers are killed: the other takes its partitions over when their
    leases expire and continues them under the same deterministic IDs. Every record is
    counted once, from the final checkpoint."""
    _producer_ledger(redis_cluster.url, tmp_path, seed=31, kills=4, take_over=True)


@pytest.mark.chaos
@pytest.mark.parametrize("seed", range(20))
def test_ledger_cluster_producer_taken_over_20_seeds(redis_cluster, tmp_path: Path,
                                                     seed: int) -> None:
    """The same, 20 times, with random kill points."""
    _producer_ledger(redis_cluster.url, tmp_path, seed=200 + seed, kills=4, take_over=True)


@pytest.mark.chaos
def test_ledger_survives_200_kills(redis_server, tmp_path: Path) -> None:
    """200 SIGKILLs, workers switching between 0 and 2: every record counted once."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    n_big = N * 8
    cf.fill(redis_server.url, spec, n_big)
    store = f"file://{tmp_path}/ckpt"
    args = _args(redis_server.url, store)
    args[args.index("--n") + 1] = str(n_big)
    kills = ledger.run_until_done(
        args, kills=200, seed=2, log=tmp_path / "job.log",
        args_for=lambda attempt: [*args, "--workers", "2" if attempt % 5 in (1, 2) else "0"],
    )
    assert kills == 200
    counts, _ = ledger.final_counts(store, n_big)
    assert torch.equal(counts, torch.ones(n_big))
