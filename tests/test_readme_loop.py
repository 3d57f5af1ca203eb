"""The training-loop guide's Python code block (docs/guides/training-loop.md, the
same as examples/quickstart.py) is a complete training loop: run as it is, on one
rank and on two ranks whose partitions hold different amounts of data, it finishes
(exit 0 on every rank) with every record of both epochs consumed exactly once: the
final checkpoint's offsets are each partition's last record, its batch counts are
what each worker's pass over its partitions cuts (each batch counted for the
partition that led it), and nothing is left pending.

"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import redis

from tests import _client_fill as cf
from tests.servers import free_port
from tests.test_session_loop import fill_epochs
from trainguard.core import streams
from trainguard.core.rank_record import checkpoint_positions

ROOT = Path(__file__).resolve().parents[1]
P, N = 3, 600  # per epoch: 200 records a partition
TEXT = np.frombuffer((ROOT / "README.md").read_bytes(), dtype=np.uint8)


def _window(i: int) -> np.ndarray:
    start = (i * 7) % (len(TEXT) - 65)
    return TEXT[start : start + 65].astype(np.int64)


def readme_loop() -> str:
    text = (ROOT / "docs" / "guides" / "training-loop.md").read_text()
    found = re.search(r"```python\n(.*?)```", text, re.S)
    assert found, "docs/guides/training-loop.md has no Python code block"
    return found.group(1)


def _run(url: str, tmp: Path, world: int) -> list[str]:
    script = tmp / "readme_loop.py"
    script.write_text(readme_loop())
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "TRAINGUARD_REDIS_URL": url, "CKPT_URL": f"file://{tmp}/ckpt",
               "RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=tmp, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:]
        outs.append(out)
    return outs


@pytest.mark.parametrize("world", [1, 2])
def test_readme_loop_runs_and_trains_every_record_once(redis_server, tmp_path, world: int) -> None:
    """With 3 partitions, 2 workers per rank and 2 ranks, rank 0 reads two partitions
    and rank 1 one: rank 1 runs out first and steps on empty batches until rank 0 is
    done; both leave the loop together and the final checkpoint commits everything."""
    spec = cf.create(redis_server.url, "tokens", partitions=P, epochs=2, sample_len=65)
    fill_epochs(redis_server.url, spec, N, 2, make=_window)
    outs = _run(redis_server.url, tmp_path, world)
    assert "records left" in outs[0]  # the progress line of a periodic checkpoint
    assert not any("differ across ranks" in o for o in outs)  # DDP keeps ranks equal

    from checkpoint_store import CheckpointStore

    store = CheckpointStore(f"file://{tmp_path}/ckpt")
    manifest = store.latest()
    assert manifest is not None
    pos = checkpoint_positions(store, manifest)  # from the ranks' state objects
    store.close()
    ends = {p: streams.make_id(1, N // P - 1) for p in range(P)}
    assert pos.offsets == ends
    # Batches span a worker's partitions; each counts for the partition that led it.
    # One rank: worker 0 reads partitions 0 and 2 (400 records an epoch: 13 batches,
    # the last short, led in turn by 0 and 2) and worker 1 partition 1 (7 batches):
    # 2 x (13 + 7) = 40 steps. Two ranks: rank 0's workers read partitions 0 and 2
    # (7 batches an epoch each, 28 steps), rank 1 reads partition 1 (14, then 14
    # empty ones): both loops ran 28 steps.
    led = {0: 13, 1: 14, 2: 13} if world == 1 else {p: 2 * 7 for p in range(P)}
    assert pos.batches == led
    assert manifest.step == (40 if world == 1 else 28)
    client = redis.Redis.from_url(redis_server.url)
    for p in range(P):
        assert client.xpending(streams.partition_key("tokens", p), "exp42")["pending"] == 0
    client.close()
