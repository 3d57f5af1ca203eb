"""A two-rank checkpoint of manifest format 3 (``tests/fixtures/ckpt_v3``, made by
``tests/fixtures/make_v3_checkpoint.py`` with the code of that time: every rank's
arrays and tensor blocks in the manifest, the per-rank state objects of version 1
indexed beside them) still verifies, loads on one rank (both ranks' rows of the
sharded tensor, rank 0's plain values) and reads each rank's state object back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from checkpoint_store import CheckpointStore

FIXTURE = Path(__file__).parent / "fixtures" / "ckpt_v3"


def test_two_rank_checkpoint_of_format_3_loads_and_its_rank_objects_read(tmp_path) -> None:
    """Format 3, 2 ranks; verify passes; a single-rank load gives w = arange(12) as
    (4, 3) (rows 0-1 from rank 0, 2-3 from rank 1), b = rank 0's arange(3), step 7;
    each rank's object is exactly the document it saved."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, root)  # the store may write (pins, gc): never the fixture
    (manifest,) = (root / "manifests").glob("*.json")
    doc = json.loads(manifest.read_bytes())
    assert (doc["version"], doc["world_size"]) == (3, 2)
    store = CheckpointStore(root)
    try:
        assert store.verify(7).step == 7
        state = {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.int64), "step": 0}
        m = store.load(state, strict=True)
        assert m is not None and m.step == 7
        assert torch.equal(state["w"], torch.arange(12, dtype=torch.float32).view(4, 3))
        assert torch.equal(state["b"], torch.arange(3, dtype=torch.int64))
        assert state["step"] == 7
        for rank in (0, 1):
            assert store.read_rank_state(m, rank) == {"rank": rank,
                                                       "note": f"rank {rank} of 2"}
    finally:
        store.close()
