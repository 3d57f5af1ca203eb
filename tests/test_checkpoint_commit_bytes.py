"""No rank receives another rank's tensor report at commit (format 4): a real 3-rank
gloo job's store collectives are counted per receiving rank, for a state of 2 and of
40 row-sharded tensors holding the same bytes a rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore
from tests._ckpt_helpers import run_ranks
from trainguard.core.checkpoints import CorruptCheckpointError

WORKER = str(Path(__file__).with_name("_ckpt_bytes_worker.py"))


def test_no_rank_receives_another_ranks_tensor_entries(tmp_path) -> None:
    """No payload any rank receives holds another rank's array names, shards or CRCs;
    what rank 0 gathers (the reports) is the same number of bytes whether the ranks
    save 2 tensors or 40, and the reductions carry 8 bytes x (7 T + 2) (the blocks'
    check, 7 int64 a tensor and one more, and the barrier before rank 0's uid is
    broadcast): a fixed size per tensor of the state, never per rank; nothing is
    all-gathered. The checkpoints load whole on one rank, and each rank's object holds
    its own blocks (rank r's rows of every tensor)."""
    root = tmp_path / "ckpt"
    out = run_ranks(WORKER, "bytes", 3, str(root), timeout_s=240)
    for rank, o in enumerate(out):
        for t in ("2", "40"):
            assert o[t]["leaks"] == [], (rank, t)
            assert o[t]["got"]["all_reduce"] == 8 * (7 * int(t) + 2)
            assert o[t]["got"].get("all_gather", 0) == 0, (rank, t)
        if rank:  # only rank 0 receives reports
            assert o["2"]["got"]["gather"] == o["40"]["got"]["gather"] == 0
    assert out[0]["2"]["got"]["gather"] == out[0]["40"]["got"]["gather"] > 0
    store = CheckpointStore(root)
    for step, tensors, cols in ((1, 2, 40), (2, 40, 2)):
        (m,) = [x for x in store.list() if x.step == step]
        doc = json.loads((root / "manifests" / m.name).read_bytes())
        assert (doc["version"], doc["arrays"], doc["tensors"], doc["nbytes"]) == \
            (4, {}, {}, 3 * 640)
        for r in range(3):
            obj = json.loads((root / "data" / m.uid / "ranks" / f"{r}.json").read_bytes())
            assert (obj["version"], obj["state"]) == (2, None)
            assert sorted(obj["arrays"]) == [f"r{r}/spack"]
            assert {k: [s["offsets"] for s in e["shards"]] for k, e in obj["tensors"].items()} \
                == {f"t{k}": [[2 * r, 0]] for k in range(tensors)}
        target = {f"t{k}": torch.zeros(6, cols) for k in range(tensors)}
        assert store.load(target, step=step, strict=True).step == step
        for k in range(tensors):
            assert torch.equal(target[f"t{k}"], torch.arange(6.0 * cols).view(6, cols) + k)
    store.close()


def test_a_damaged_rank_object_makes_the_checkpoint_damaged(tmp_path) -> None:
    """One byte changed in rank 1's object of a format 4 checkpoint: listing it still
    works (it reads no object), but verify and a strict load refuse it as damaged,
    naming rank 1, and change nothing in the target."""
    root = tmp_path / "ckpt"
    run_ranks(WORKER, "bytes", 3, str(root), timeout_s=240)
    store = CheckpointStore(root)
    (m,) = [x for x in store.list() if x.step == 2]
    obj = root / "data" / m.uid / "ranks" / "1.json"
    obj.write_bytes(obj.read_bytes().replace(b'"rank":1', b'"rank":7'))
    fresh = CheckpointStore(root)
    assert [x.step for x in fresh.list()] == [1, 2]
    with pytest.raises(CorruptCheckpointError, match="rank 1"):
        fresh.verify(2)
    target = {f"t{k}": torch.zeros(6, 2) for k in range(40)}
    with pytest.raises(CorruptCheckpointError, match="rank 1"):
        fresh.load(target, step=2, strict=True)
    assert all(not t.any() for t in target.values())
    fresh.close()
    store.close()
