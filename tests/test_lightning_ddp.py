"""Lightning DDP through the trainguard session (2 processes, gloo on CPU): each rank
reads its own partitions, the offsets of both are committed with Lightning's
checkpoint, and the world size may change between restarts. SIGKILL of one rank, then
a resume on 1 process (SIGKILLed), then on 2 (both SIGKILLed), then on 2 to the end:
every record trained exactly once."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer
from tests.test_integration_lightning import final_counts

N = 480
P = 4


def _args(url: str, tmp_path: Path, workers: int = 0) -> list[str]:
    return ["--redis", url, "--dataset", "tok", "--run", "ddp", "--store",
            f"file://{tmp_path}/ckpt", "--ckpt-dir", str(tmp_path / "lightning"), "--n", str(N),
            "--batch-size", "8", "--ckpt-every", "4", "--sleep-ms", "2",
            "--workers", str(workers)]


def _kill_one_rank(job: ledger.Job, rank: int, timeout_s: float = 60) -> None:
    """SIGKILL one rank; the other fails in its next collective (or, if it waits
    there, is SIGKILLed too once ``timeout_s`` passed)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(job.pids[rank], signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while len(job.exits) < job.world and time.monotonic() < deadline:
        job.next_line(0.2)
    job.kill()
    assert job.exits[rank] == -9, job.seen[-20:]


def kill_across_world_sizes(z: ledger.Zygote, args: list[str], rng: random.Random,
                            first: int) -> None:
    """World sizes 2 (rank ``first`` SIGKILLed), 1 (killed), 2 (both killed), each
    after 3-10 steps, then 2 to the end, where rank 1 must train."""
    for world, victim in ((2, first), (1, None), (2, None)):
        job = z.spawn(args, world)
        assert job.wait_line("STEP", 180, nth=rng.randint(3, 10)), job.seen[-20:]
        if victim is None:
            job.kill()
        else:
            _kill_one_rank(job, victim)
    job = z.spawn(args, 2)
    job.finish(300)
    assert any(s.startswith("1: STEP") for s in job.seen), "rank 1 trained no step"


def newest_world_size(store_url: str) -> int:
    from checkpoint_store import CheckpointStore
    from trainguard.core.newest import newest_first
    from trainguard.core.record import SessionRecord

    with CheckpointStore(store_url) as store:
        rec = SessionRecord.of(newest_first(store.list())[0])
    assert rec is not None, "the newest commit has no session record"
    return rec.world_size


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("seed", [1, *(pytest.param(s, marks=pytest.mark.chaos)
                                      for s in range(2, 12))])
def test_lightning_ddp_survives_rank_kills_and_world_size_changes(
        redis_server: RedisServer, tmp_path: Path, seed: int, workers: int) -> None:
    """World sizes 2, 1, 2, 2: one rank killed (rank 1; under chaos, either), then the
    one process, then both ranks; the last run finishes: 0 lost, 0 duplicated. With
    ``workers=2`` each rank reads through 2 DataLoader workers (batches they read
    ahead and the kill lost are read again, never counted)."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    rng = random.Random(seed)
    args = _args(redis_server.url, tmp_path, workers)
    with ledger.zygote(tmp_path / "job.log", "tests._lightning_job") as z:
        kill_across_world_sizes(z, args, rng, first=1 if seed == 1 else rng.choice([0, 1]))
    assert newest_world_size(f"file://{tmp_path}/ckpt") == 2
    counts = final_counts(f"file://{tmp_path}/ckpt")
    assert len(counts) == N
    ledger.assert_each_once(counts)
