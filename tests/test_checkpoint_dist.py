"""Multi-rank checkpoints over gloo: 2 ranks save their Shard blocks, rank 0 commits
only when both succeed; the checkpoint loads on 1 and on 3 ranks (resharding)."""

from __future__ import annotations

from pathlib import Path

from checkpoint_store import CheckpointStore
from tests._ckpt_helpers import run_ranks

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_ckpt_dist_worker.py"


def _run(mode: str, world: int, root: Path, *extra: str) -> list[dict]:
    return run_ranks(str(WORKER), mode, world, str(root), *extra)


def test_two_rank_save_loads_on_one_and_three_ranks(tmp_path):
    """Step 2 saved by 2 ranks (row and uneven column blocks, plus replicated values)
    is one manifest with world_size 2, and loads bit-exact on 1 rank (whole tensors)
    and on 3 ranks (other blocks, each assembled from the saved ones)."""
    root = tmp_path / "ckpt"
    saved = _run("save", 2, root)
    assert [r.get("error") for r in saved] == [None, None]
    assert saved[0]["step2"] == saved[1]["step2"] and saved[0]["steps"] == [1, 2]
    assert saved[0]["world_size"] == 2
    manifest = CheckpointStore(root).latest()
    assert sorted({a.split("/")[0] for a in manifest.arrays}) == ["r0", "r1"]
    assert len(manifest.tensors["g"]["shards"]) == 2 and len(manifest.tensors["bias"]["shards"]) == 1

    for world in (1, 3):
        loaded = _run("load", world, root)
        assert [(r["step"], r["ok"]) for r in loaded] == [(2, True)] * world


def test_failing_rank_aborts_the_commit(tmp_path):
    """Rank 1 hits an I/O error mid-data while saving step 2: no rank commits, rank 0
    reports which rank failed, step 1 stays the newest and its data is all that is
    left; the checkpoint then loads on 3 ranks."""
    root = tmp_path / "ckpt"
    saved = _run("save", 2, root, "1")
    assert "DistributedSaveError" in saved[0]["error"] and "rank 1" in saved[0]["error"]
    assert "CheckpointWriteError" in saved[1]["error"]
    assert saved[0]["steps"] == [1] and saved[1]["steps"] == [1]
    store = CheckpointStore(root)
    assert {p.name for p in (root / "data").iterdir()} == {store.latest().uid}
    assert store.gc().removed_data == []
    loaded = _run("load", 3, root)
    assert [(r["step"], r["ok"]) for r in loaded] == [(1, True)] * 3
