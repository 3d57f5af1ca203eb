"""Lightning markers never name a lost save, and a resume never rolls back further than
it must: a Lightning fit SIGKILLed between a commit and its marker (``last.ckpt`` or the
top-k file Lightning writes first), twice in a row, and then resumed with
``ckpt_path="last"``, resumes the newest commit each time, finds the commit every
``last.ckpt`` names still in the store (``keep_last=2``), and trains every record
exactly once."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from tests import _client_fill as cf
from tests import _client_ledger as ledger
from tests.servers import RedisServer
from tests.test_integration_lightning import final_counts

N = 160  # 20 steps of 8
P = 4
SEEDS = 40
EVERY = 3


def _commits_left(step: int) -> int:
    """Commits a run resumed at ``step`` still makes: ModelCheckpoint's, then the
    job's final save (a fresh run's step-0 commit comes on top)."""
    return len([s for s in range(step + 1, N // 8) if s % EVERY == 0]) + 1


def _store_commits(store_url: str) -> list[tuple[int, str | None]]:
    """(step, lightning commit id) of the store's checkpoints, newest first (restore order)."""
    from checkpoint_store import CheckpointStore
    from trainguard.core.newest import newest_first
    from trainguard.integrations._lineage import lineage_of

    store = CheckpointStore(store_url)
    try:
        return [(m.step, lineage_of(m)[0]) for m in newest_first(store.list())]
    finally:
        store.close()


def _started(job: ledger.Job) -> int:
    starts = [int(s.split()[-1]) for s in job.seen if s.startswith("0: START ")]
    assert len(starts) == 1, job.seen[-30:]
    return starts[0]


def _wait_exit(job: ledger.Job, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while not job.exits and time.monotonic() < deadline:
        job.next_line(0.5)
    if not job.exits:
        job.kill()
        raise AssertionError(f"job did not exit in {timeout_s} s: {job.seen[-30:]}")
    return job.exits[0]


def _marker_names_a_kept_commit(root: Path, store_url: str) -> None:
    """The ``last`` marker ``ckpt_path="last"`` resumes (Lightning: the newest
    ``last*.ckpt``) names a commit the store still holds."""
    lasts = sorted((root / "lightning").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not lasts:  # killed before the very first marker
        return
    marker = json.loads(lasts[-1].read_text())
    kept = [c for _, c in _store_commits(store_url)]
    assert marker["commit"] in kept, (
        f"{lasts[-1].name} names commit {marker['commit']} (step {marker['step']}), which "
        f"the store no longer holds: {kept}")


def _twice_killed_before_markers(z: ledger.Zygote, url: str, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    run = f"pl{seed}"
    root = tmp_path / run
    store_url = f"file://{root}/ckpt"
    args = ["--redis", url, "--dataset", "tok", "--run", run, "--store", store_url,
            "--ckpt-dir", str(root / "lightning"), "--n", str(N), "--batch-size", "8",
            "--ckpt-every", str(EVERY)]
    for _attempt in range(2):
        commits = _store_commits(store_url)
        newest = commits[0][0] if commits else 0
        # Any commit of the attempt: the k-th, before its last.ckpt or its first marker.
        die = f"{rng.randint(1, _commits_left(newest))}:{rng.choice(['last', 'any'])}"
        job = z.spawn([*args, "--die-before-marker", die], 1)
        code = _wait_exit(job)
        assert code == -9 and any(s.startswith("0: DYING") for s in job.seen), job.seen[-30:]
        assert _started(job) == newest, f"seed {seed}: resumed step {_started(job)}, newest {newest}"
        _marker_names_a_kept_commit(root, store_url)
    newest = _store_commits(store_url)[0][0]
    job = z.spawn(args, 1)
    job.finish(300)
    assert _started(job) == newest, f"seed {seed}: resumed step {_started(job)}, newest {newest}"
    counts = final_counts(store_url)
    assert len(counts) == N
    ledger.assert_each_once(counts)


@pytest.fixture
def filled(redis_server: RedisServer) -> str:
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    return redis_server.url


def test_two_kills_between_commit_and_marker_resume_the_newest_commit(
        filled: str, tmp_path: Path) -> None:
    """Killed twice in a row between a commit and its marker: each resume starts at the
    newest commit, last.ckpt always names a commit the store holds, each record once."""
    with ledger.zygote(tmp_path / "job.log", "tests._lightning_job") as z:
        _twice_killed_before_markers(z, filled, tmp_path, seed=3)


@pytest.mark.chaos
def test_two_kills_between_commit_and_marker_in_40_seeds(filled: str, tmp_path: Path) -> None:
    """The same in 40 seeds (kill points: any commit of each attempt, before its
    last.ckpt or before its first marker): all 40 pass."""
    with ledger.zygote(tmp_path / "job.log", "tests._lightning_job") as z:
        for seed in range(SEEDS):
            _twice_killed_before_markers(z, filled, tmp_path, seed)
