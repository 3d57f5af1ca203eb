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


def _story(url: str, n: int) -> None:
    """``n`` packed records of 65 token ids below the vocabulary (512), as the example's
    ``--pack 65`` ingest makes them, in 4 partitions."""
    import numpy as np

    from tests import _client_fill as cf

    spec = cf.create(url, "story", partitions=4, sample_len=65)
    cf.fill(url, spec, n, make=lambda i: (np.arange(65, dtype=np.int64) * 7 + i) % 512)


def test_hf_example_on_two_torchrun_ranks_killed_and_resumed_trains_each_once(
        redis_server: RedisServer, tmp_path: Path) -> None:
    """``torchrun --standalone --nproc-per-node 2 examples/hf_gpt.py --die-at-step 6``
    fails (each rank SIGKILLs itself after step 6, past the step-4 checkpoint); the same
    command without ``--die-at-step`` exits 0, and each rank's own report says every
    sequence was trained exactly once across both ranks (0 lost, 0 duplicated)."""
    _story(redis_server.url, 128)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "examples/hf_gpt.py", "--redis-url", redis_server.url, "--dataset", "story",
           "--run-name", "hf2", "--dir", str(tmp_path), "--batch-size", "8",
           "--ckpt-every", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TMPDIR": str(tmp_path)}
    died = subprocess.run([*cmd, "--die-at-step", "6"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    tail = died.stdout[-3000:] + died.stderr[-3000:]
    assert died.returncode != 0 and "SIGKILL at step 6" in died.stdout, tail
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    assert "resumed from step 4" in out.stdout, tail
    assert out.stdout.count("sequences trained: 128 of 128; each exactly once") == 2, tail
