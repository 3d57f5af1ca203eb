"""A restore's new fencing generation on the per-rank path: rank 0 takes it from the
run's counter (one key), each rank raises the fences of its own partitions only, and
a zombie of the older generation (reading, about to commit) commits nothing."""

from __future__ import annotations

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
    the run. Every fence is raised to generation 2 exactly once, each connection
    raised exactly one rank's partitions (rank_partitions), none all 8 (before, rank 0
    wrote every fence); the generation counter says 2. The zombie's checkpoint is
    refused with FencedError, and no manifest of generation 1 exists."""
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

    bump = groups.script_sha(groups.BUMP_LUA)
    fences = {streams.fence_key("tok", p, "exp"): p for p in range(P)}
    by_conn: dict[tuple[str, str], list[int]] = {}
    for cmd in seen:
        words = cmd["command"].split()
        if words[:2] == ["EVALSHA", bump] and words[-1] == "2":
            p = fences[words[3]]
            by_conn.setdefault((cmd["client_address"], cmd["client_port"]), []).append(p)
    fenced = sorted(p for ps in by_conn.values() for p in ps)
    assert fenced == list(range(P))  # every fence once
    ranks = [streams.rank_partitions(P, world_size=2, num_workers=0, rank=r) for r in range(2)]
    assert sorted(sorted(ps) for ps in by_conn.values()) == sorted(ranks)
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
