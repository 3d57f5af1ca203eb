"""A restore's new fencing generation on the per-rank path: rank 0 takes it from the
run's counter (one key), each rank raises the fences of its own partitions only, and
a zombie of the older generation (reading, about to commit) commits nothing."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from torch.utils.data import DataLoader

from checkpoint_store import CheckpointStore
from tests import _client_fill as cf
from tests.test_rank_skips import _ranks
from trainer_client import TrainingSession
from trainer_client import offsets as ofs
from trainer_client.errors import FencedError
from trainguard.core import groups, streams
from trainguard.core.record import SessionRecord

N, P = 160, 8
_STOP = "tg-test-monitor-stop"


def _monitor(url: str, seen: list[dict[str, Any]], ready: threading.Event) -> None:
    """Every command the server runs, until the stop marker (MONITOR)."""
    client = redis.Redis.from_url(url, socket_timeout=None)
    with client.monitor() as m:
        ready.set()
        while True:
            cmd = m.next_command()
            if _STOP in cmd["command"]:
                break
            seen.append(cmd)
    client.close()


def test_each_rank_fences_its_own_partitions_and_the_zombie_commits_nothing(
        redis_server, tmp_path: Path) -> None:
    """A 1-rank trainer (generation 1) reads and holds batches; a 2-rank job restores
    the run. Every fence is raised to generation 2 by the script that seeks and
    acknowledges its partition, each connection placing exactly one rank's partitions
    (rank_partitions) in one script call, none all 8 (before, rank 0 wrote every
    fence), and no pass of fences of its own; the generation counter says 2. The
    zombie's checkpoint is refused with FencedError, and no manifest of generation 1
    exists."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    url = f"file://{tmp_path}/c"
    zombie = TrainingSession(redis_server.url, dataset="tok", run="exp", store=url,
                             block_ms=100)
    state = {"model": torch.nn.Linear(4, 1)}
    assert zombie.restore(state) == 0 and zombie.generation == 1
    it = iter(zombie.batches(DataLoader(zombie.dataset(batch_size=4), batch_size=None)))
    next(it)

    seen: list[dict[str, Any]] = []
    ready = threading.Event()
    watcher = threading.Thread(target=_monitor, args=(redis_server.url, seen, ready))
    watcher.start()
    assert ready.wait(30)
    try:
        _ranks(redis_server.url, url, 2, 2)
    finally:
        stopper = redis.Redis.from_url(redis_server.url)
        stopper.echo(_STOP)
        stopper.close()
        watcher.join(30)

    fence = groups.script_sha(groups.FENCE_MANY_LUA)
    place = groups.script_sha(groups.PLACE_MANY_LUA)
    streams_ = {streams.partition_key("tok", p): p for p in range(P)}
    placed: dict[tuple[str, str], list[list[int]]] = {}
    for cmd in seen:
        words = cmd["command"].split()
        assert words[:2] != ["EVALSHA", fence]  # the seek fences: no pass of its own
        n = int(words[2]) if words[:2] == ["EVALSHA", place] else 0
        if n and words[3 + n + 1:3 + n + 3] == ["2", "seek"]:
            keys = words[3:3 + n]
            conn = (cmd["client_address"], cmd["client_port"])
            placed.setdefault(conn, []).append([streams_[k] for k in keys[::3]])
    # The seek and acknowledgement of a rank's partitions, their fences raised in the
    # same script: one script call per rank (not one per partition), together every
    # partition once.
    ranks = [streams.rank_partitions(P, world_size=2, num_workers=0, rank=r) for r in range(2)]
    assert sorted(sorted(calls[0]) for calls in placed.values()) == sorted(ranks)
    assert all(len(calls) == 1 for calls in placed.values())
    client = redis.Redis.from_url(redis_server.url)
    assert client.get(streams.generation_key("tok", "exp")) == b"2"
    assert [int(client.get(streams.fence_key("tok", p, "exp"))) for p in range(P)] == [2] * P
    client.close()

    with pytest.raises(FencedError, match="generation 2 has restored"):
        zombie.checkpoint(state, 1, blocking=True)
    zombie.close()
    store = CheckpointStore(url, keep_last=100)
    gens = [rec.generation for m in store.list() if (rec := SessionRecord.of(m)) is not None]
    store.close()
    assert gens == [2]


def test_the_loop_goes_on_before_the_fence_check_and_the_zombie_still_commits_nothing(
        redis_server, tmp_path: Path) -> None:
    """With per-rank objects, ``checkpoint()`` sends Redis nothing: it returns while the
    server is stopped (SIGSTOP: any command would wait for the SIGCONT), with its save
    not yet done, because the fence check runs in the save's background
    writer. The trainer is a zombie (a newer session restored the run): once Redis
    answers again, its handle fails with FencedError, its next call raises it, and no
    manifest of its generation exists (the newer one's checkpoint is the only one)."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    url = f"file://{tmp_path}/c"
    zombie = TrainingSession(redis_server.url, dataset="tok", run="exp", store=url,
                             block_ms=100)
    state = {"model": torch.nn.Linear(4, 1)}
    zombie.restore(state)
    it = iter(zombie.batches(DataLoader(zombie.dataset(batch_size=4), batch_size=None)))
    next(it)
    newer = TrainingSession(redis_server.url, dataset="tok", run="exp", store=url)
    newer.restore({"model": torch.nn.Linear(4, 1)})
    newer.checkpoint({"model": torch.nn.Linear(4, 1)}, 1, blocking=True)
    got: list[Any] = []
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        caller = threading.Thread(target=lambda: got.append(zombie.checkpoint(state, 2)))
        caller.start()
        # A call that sent Redis a command would wait for the SIGCONT below.
        caller.join(60)
        assert not caller.is_alive(), "checkpoint() waited for Redis"
        assert len(got) == 1 and not got[0].done()
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    with pytest.raises(FencedError, match="checkpoint refused"):
        got[0].wait(60)
    with pytest.raises(FencedError, match="checkpoint refused"):
        zombie.checkpoint(state, 3)
    zombie.close()
    newer.close()
    store = CheckpointStore(url, keep_last=100)
    gens = [(m.step, rec.generation) for m in store.list()
            if (rec := SessionRecord.of(m)) is not None]
    store.close()
    assert gens == [(1, 2)]


def test_a_restores_fences_never_lower_one_that_is_higher(redis_server) -> None:
    """``fence_partitions`` at generation 5 over partitions whose fences hold 2, none
    and 9: the first two hold 5 after it, the third still 9 (put back in the same
    script: a fence is never lowered), and the highest fence found, 9, is returned, so
    the restore takes another generation instead of seeking under this one."""
    r = redis.Redis.from_url(redis_server.url)
    keys = [streams.fence_key("tok", p, "exp") for p in range(3)]
    r.set(keys[0], 2)
    r.set(keys[2], 9)
    assert ofs.fence_partitions(r, "tok", "exp", 5, [0, 1, 2]) == 9
    assert [int(r.get(k) or 0) for k in keys] == [5, 5, 9]
    assert ofs.fence_partitions(r, "tok", "exp", 9, [0, 1, 2]) == 9
    assert [int(r.get(k) or 0) for k in keys] == [9, 9, 9]
    r.close()


def test_a_restores_placement_raises_each_fence_or_refused_changes_nothing(
        redis_server) -> None:
    """``place_partitions`` at generation 5 over partitions whose fences hold 2 and
    none: both hold 5 after it, and the group of each is at its offset. At generation
    7 over partitions whose fences hold 5, none and 9 (a fence written without the
    run's counter): FencedError naming 9, and nothing moved: the fences hold 5, none
    and 9 again (a refused call puts back what it found), the groups are where they
    were."""
    r = redis.Redis.from_url(redis_server.url)
    keys = [streams.fence_key("tok", p, "exp") for p in range(3)]
    for p in range(3):
        r.xadd(streams.partition_key("tok", p), {"d": "x"}, id="1-0")
        r.xadd(streams.partition_key("tok", p), {"d": "y"}, id="2-0")
    r.set(keys[0], 2)
    ofs.place_partitions(r, "tok", "exp", 5, {0: "1-0", 1: "2-0"})
    assert [r.get(k) for k in keys] == [b"5", b"5", None]

    def last(p: int) -> bytes:
        (g,) = r.xinfo_groups(streams.partition_key("tok", p))
        return g["last-delivered-id"]

    assert [last(0), last(1)] == [b"1-0", b"2-0"]
    r.delete(keys[1])
    r.set(keys[2], 9)
    with pytest.raises(FencedError) as refused:
        ofs.place_partitions(r, "tok", "exp", 7, {0: "2-0", 1: "1-0", 2: "1-0"})
    assert refused.value.current == 9
    assert [r.get(k) for k in keys] == [b"5", None, b"9"]
    assert [last(0), last(1)] == [b"1-0", b"2-0"]
    assert r.xinfo_groups(streams.partition_key("tok", 2)) == []
    r.close()


def test_a_fence_above_the_counter_makes_the_restore_take_a_higher_generation(
        redis_server, tmp_path: Path) -> None:
    """A fence at 7 that the run's counter (0) never gave (written by an older
    trainguard, or before Redis lost the counter): the restore's placement at
    generation 1 is refused there, every rank takes generation 8 instead and places
    every partition at it; every fence holds 8 and the run reads every record."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    r = redis.Redis.from_url(redis_server.url)
    r.set(streams.fence_key("tok", 3, "exp"), 7)
    session = TrainingSession(redis_server.url, dataset="tok", run="exp",
                              store=f"file://{tmp_path}/c", block_ms=100)
    assert session.restore({"model": torch.nn.Linear(4, 1)}) == 0
    assert session.generation == 8
    assert [int(r.get(streams.fence_key("tok", p, "exp"))) for p in range(P)] == [8] * P
    loader = DataLoader(session.dataset(batch_size=4), batch_size=None)
    seen = [int(i) for b in session.batches(loader) for i in b.data[:, 0].tolist()]
    assert sorted(seen) == list(range(N))
    session.close()
    r.close()
