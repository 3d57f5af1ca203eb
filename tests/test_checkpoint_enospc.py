"""A full disk fails the save with a clear error and leaves the previous checkpoint
loadable: on a real 1 MiB tmpfs (private mount namespace) and on an fsspec store
that runs out of space part-way through a file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, CheckpointWriteError
from tests._ckpt_fs import PROTOCOL, can_mount_tmpfs, limited_store_options

REPO = Path(__file__).resolve().parent.parent



def test_full_tmpfs_fails_cleanly_and_keeps_previous(tmp_path):
    """Saving 1.6 MB onto a 1 MiB tmpfs raises CheckpointWriteError(ENOSPC) saying
    the previous checkpoint is intact; step 1 then loads strictly and verifies, the
    failed save left no data behind, and a later small save succeeds."""
    if not can_mount_tmpfs(tmp_path):
        pytest.skip("unprivileged mount namespaces are not available here; the fsspec "
                    "ENOSPC test below covers the same path")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && "
              f"exec {sys.executable} {REPO / 'tests' / '_ckpt_enospc.py'} {mnt}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True,
                          timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    out = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert out["error"]["errno"] == errno.ENOSPC
    assert "previous checkpoint is intact" in out["error"]["message"]
    assert out["loaded"] == 1 and out["w_ok"] and out["steps"] == [1] and out["verify"] == 1
    assert out["data_dirs"] == 1  # the failed save cleaned up after itself
    assert out["after"] == [1, 3]


def test_enospc_part_way_on_fsspec_store():
    """The store fills up in the middle of a chunk file: the save raises
    CheckpointWriteError (an OSError with errno ENOSPC), no manifest appears, and
    step 1 still loads and verifies."""
    store = CheckpointStore(f"{PROTOCOL}://full-{uuid.uuid4().hex}", chunk_bytes=16 << 10,
                            storage_options=limited_store_options(limit_bytes=100_000))
    store.save({"w": torch.arange(1000.0)}, step=1)
    with pytest.raises(OSError) as info:
        store.save({"w": torch.ones(50_000)}, step=2)
    assert isinstance(info.value, CheckpointWriteError) and info.value.errno == errno.ENOSPC
    assert [m.step for m in store.list()] == [1]
    target = {"w": torch.zeros(1000)}
    assert store.load(target, strict=True).step == 1
    assert torch.equal(target["w"], torch.arange(1000.0)) and store.verify(1).step == 1
