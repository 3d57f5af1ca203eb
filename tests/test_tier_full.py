"""A full local tier heals: with the local disk of a TieredCheckpointStore full (a real
tmpfs in a private mount namespace, filled to ENOSPC), training goes on, checkpoints
go to the remote tier only, and a crash in between loses and repeats no record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import _client_fill as cf
from tests._ckpt_fs import can_mount_tmpfs
from tests._client_ledger import final_counts

REPO = Path(__file__).resolve().parent.parent



def test_full_local_tier_trains_every_record_once_through_a_crash(
        redis_server: Any, tmp_path: Path) -> None:
    """The local tier is a 1 MiB tmpfs filled to ENOSPC before the first save. The
    first attempt checkpoints at steps 3 and 6 (both to the remote tier only, logged
    as a full local tier) and dies hard after step 7; the second restores step 6 from
    the remote tier and finishes. The final checkpoint's ledger says every record was
    trained exactly once, it verifies and restores from a fresh store, and the local
    tier holds no checkpoint (none was torn or half-committed there)."""
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("unprivileged mount namespaces are not available here")
    n = 40
    spec = cf.create(redis_server.url, "heal", partitions=1)
    cf.fill(redis_server.url, spec, n)
    mnt, remote = tmp_path / "local", f"file://{tmp_path}/remote"
    mnt.mkdir()
    job = f"{sys.executable} -m tests._tier_full_job {redis_server.url} {mnt} {remote} {n}"
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} || exit 90; "
              f"{job} --crash-at 7; echo \"FIRST $?\"; exec {job}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "FIRST 9" in lines, proc.stdout[-2000:]
    out = json.loads(lines[-1])
    assert out["step"] == n // 4 and out["remote_only_saves"] >= 1
    assert out["local_steps"] == []
    assert "is full" in proc.stderr and "goes to" in proc.stderr

    counts, _ = final_counts(remote, n)
    assert torch.equal(counts, torch.ones(n))
    from checkpoint_store import CheckpointStore

    store = CheckpointStore(remote)
    try:
        assert store.verify(n // 4).step == n // 4
        assert sorted(m.step for m in store.list()) == [3, 6, 9, 10]
    finally:
        store.close()


def test_full_local_tier_makes_room_from_copies_already_safe_remotely(tmp_path: Path) -> None:
    """Steps 1 and 2 are uploaded, then the 1 MiB local tmpfs is filled to ENOSPC: the
    save of step 3 drops the local copies of 1 and 2 (their remote copies are
    committed; keep_last=3 gives way) and succeeds locally on the second try, not on
    the remote tier only. Step 3 loads strictly with its values, and the remote tier
    still holds 1 and 2 and gets 3."""
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("unprivileged mount namespaces are not available here")
    mnt, remote = tmp_path / "local", f"file://{tmp_path}/remote"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && "
              f"exec {sys.executable} -m tests._tier_full_free {mnt} {remote}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["local"] == [3] and out["remote_only_saves"] == 0
    assert out["loaded"] == 3 and out["w_ok"]
    assert out["remote"] == [1, 2, 3]
    assert "dropping 2 local copies" in proc.stderr
