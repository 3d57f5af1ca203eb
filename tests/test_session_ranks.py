"""Two ranks whose partitions hold different amounts of data (3 partitions: rank 0
reads two, rank 1 one) leave ``session.batches()`` together, so the collective
checkpoint after the loop completes on both; and a state value that differs across
ranks without being a ``Shard`` is named in a warning instead of dropped silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import _client_fill as cf
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]
N, P = 60, 3  # 20 records a partition: 5 batches of 4


def _ranks(url: str, store: str, *extra: str) -> list[tuple[int, int, list[int], str]]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests._session_ranks", "--redis", url, "--store", store, *extra],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, text[-3000:]
        line = next(x for x in text.splitlines() if x.startswith("STEPS "))
        _, steps, _, n, _, ids = line.split(" ")
        out.append((int(steps), int(n), [int(i) for i in ids.split(",") if i], text))
    return out


def test_join_steps_the_short_rank_on_empty_batches(redis_server, tmp_path) -> None:
    """uneven="join" (default): both loops run 10 steps (rank 0's batch count); rank 1
    consumes its 20 records in 5, then steps on 5 empty batches; every record once.
    ``note`` differs across ranks and is not a Shard: rank 0's checkpoint warns,
    naming it (and not the model, which is equal on both)."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    (s0, n0, ids0, out0), (s1, n1, ids1, _) = _ranks(redis_server.url, f"file://{tmp_path}/c",
                                                     "--diverge")
    assert (s0, s1, n0, n1) == (10, 10, 40, 20)
    assert sorted(ids0 + ids1) == list(range(N))
    warning = next(x for x in out0.splitlines() if "differ across ranks" in x)
    assert "'note'" in warning and "'model'" not in warning


def test_stop_ends_every_rank_with_the_first_and_keeps_the_rest(redis_server, tmp_path) -> None:
    """uneven="stop": both loops end after 5 steps (when rank 1 runs out); rank 0's
    unconsumed records are not committed, so a later run reads exactly those."""
    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    store = f"file://{tmp_path}/c"
    (s0, n0, ids0, _), (s1, n1, ids1, _) = _ranks(redis_server.url, store, "--mode", "stop")
    assert (s0, s1, n0, n1) == (5, 5, 20, 20)
    (t0, m0, rest0, _), (t1, m1, rest1, _) = _ranks(redis_server.url, store)
    assert (m0, m1) == (20, 0) and (t0, t1) == (10, 10)
    assert sorted(ids0 + ids1 + rest0 + rest1) == list(range(N))
