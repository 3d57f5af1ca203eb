"""A rerun of a finished run says it is finished and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import _client_fill as cf
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]
N, P = 100, 4


def _train(url: str, store: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_rerun_train.py"), "--redis", url,
         "--store", store], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    return proc


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root``: its size and modification time (ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_rerun_of_a_finished_run_logs_that_it_is_finished_and_writes_nothing(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """A finite dataset of 100 records in 4 partitions, trained to its end by a loop
    that checkpoints every 3 steps and unconditionally at the end (13 batches of up to
    8: step 13). Run again, the same loop gets no batch, its final checkpoint call
    writes nothing (every file of the store is the same, size and mtime, and the
    store lists the same checkpoints), and the session logs exactly one line saying
    the run is finished, with the checkpoint's name and step 13."""
    from checkpoint_store import CheckpointStore

    spec = cf.create(redis_server.url, "tok", partitions=P)
    cf.fill(redis_server.url, spec, N)
    root = tmp_path / "ckpt"
    store = f"file://{root}"
    first = _train(redis_server.url, store)
    assert "BATCHES 13" in first.stdout and "STEP 13" in first.stdout, first.stdout
    assert "is finished" not in first.stderr
    listed = CheckpointStore(store)
    try:
        before = [(m.name, m.step) for m in listed.list()]
    finally:
        listed.close()
    assert max(s for _, s in before) == 13, before
    files = _files(root)

    again = _train(redis_server.url, store)
    assert "BATCHES 0" in again.stdout and "STEP 13" in again.stdout, again.stdout
    assert _files(root) == files
    listed = CheckpointStore(store)
    try:
        assert [(m.name, m.step) for m in listed.list()] == before
    finally:
        listed.close()
    finished = [line for line in again.stderr.splitlines() if "is finished" in line]
    newest = max(before, key=lambda m: m[1])
    assert len(finished) == 1, again.stderr
    assert f"checkpoint {newest[0]} (step 13)" in finished[0], finished
