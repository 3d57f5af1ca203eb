"""The examples run under ``torchrun`` exactly as docs/guides/integrations.md writes
them: ``--run-name`` reaches the script (torchrun takes ``--run``, wherever it stands,
for an abbreviation of its own ``--run-path`` and stops)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.servers import RedisServer
from tests.test_resume_bitwise import _fill

ROOT = Path(__file__).resolve().parents[1]


def test_train_gpt_under_torchrun_with_run_name_trains_the_named_run(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 1 examples/train_gpt.py ... --run-name
    foo`` exits 0 after the last step (60) and commits its checkpoints under run foo."""
    _fill(redis_server.url)
    store = f"file://{tmp_path}/ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "examples/train_gpt.py", "--redis-url", redis_server.url, "--dataset", "text",
           "--run-name", "foo", "--store", store]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "0: DONE 60" in out.stdout, out.stdout[-2000:]
    from checkpoint_store import CheckpointStore
    from trainguard.core.record import SessionRecord

    with CheckpointStore(store) as ckpt:
        records = [SessionRecord.of(m) for m in ckpt.list()]
    assert records and {r.run for r in records if r is not None} == {"foo"}, records
