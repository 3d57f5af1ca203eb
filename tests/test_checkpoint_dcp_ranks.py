"""A two-rank gloo job's TrainingSession on DcpCheckpointStore writes per-rank state
objects (no rank gathers another's offsets), and a restarted job restores each rank's
object exactly: its partitions' offsets and its random state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import _client_fill as cf
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]


def _job(mode: str, url: str, store: str) -> list[dict]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests._dcp_session_ranks", mode, url, store],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, text[-3000:]
        out.append(json.loads(next(x for x in reversed(text.splitlines()) if x.startswith("{"))))
    return out


def test_dcp_session_per_rank_objects_restore_exactly(redis_server, tmp_path) -> None:
    """Each rank's object holds the offsets of its own partitions only (together: all
    4, each once) and the manifest's record holds none (session record 4, an index of
    the objects); after a restart each rank's restored offsets are its object's and
    its generator continues exactly where it was checkpointed (same draws)."""
    spec = cf.create(redis_server.url, "tok", partitions=4)
    cf.fill(redis_server.url, spec, 80)
    store = f"file://{tmp_path}/ckpt"
    saved = _job("save", redis_server.url, store)
    restored = _job("restore", redis_server.url, store)
    owned = [set(s["object"]["offsets"]) for s in saved]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {"0", "1", "2", "3"}
    for rank, (s, r) in enumerate(zip(saved, restored)):
        assert s["indexed"] and s["object"]["rank"] == rank
        assert "offsets" not in s["record"] and s["record"]["version"] == 4
        assert s["offsets"] == s["object"]["offsets"]  # what this rank consumed
        assert r["step"] == 3
        assert r["object"] == s["object"]
        assert r["offsets"] == s["object"]["offsets"]
        assert r["draws"] == s["draws"]
    assert saved[0]["draws"] != saved[1]["draws"]  # the ranks' states differ: both restored
