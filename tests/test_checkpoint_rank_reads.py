"""A load of a format 4 checkpoint reads only the rank objects that hold its blocks
(issue #26): real 4-rank gloo jobs save DTensor ``Shard(0)`` and ``Shard`` blocks
(with and without a plain tensor that only rank 0 writes), and every restoring
rank's store counts the ``ranks/<r>.json`` reads of its own backend."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from checkpoint_store import CheckpointStore, Shard
from checkpoint_store.rank_content import RankReads
from tests._ckpt_helpers import run_ranks

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_ckpt_reads_worker.py"


def _run(mode: str, world: int, root: Path, kind: str) -> list[dict]:
    return run_ranks(str(WORKER), mode, world, str(root), kind)


def test_same_world_reads_own_object_and_rank_0s_for_replicated_tensors(tmp_path):
    """Saved and restored on 4 ranks: rank r reads object r, and object 0 only when
    the state holds a plain tensor (rank 0 writes those); every byte loads exactly.
    Restored on 2 ranks: each reads the objects of the saved ranks whose rows it
    now holds (and 0's for the plain tensor), and loads the same bytes."""
    for kind in ("replicated", "sharded"):
        root = tmp_path / kind
        saved = _run("save", 4, root, kind)
        assert [r["world_size"] for r in saved] == [4] * 4
        loaded = _run("load", 4, root, kind)
        assert [(r["step"], r["same"]) for r in loaded] == [(2, True)] * 4
        if kind == "replicated":
            assert [r["rank_reads"] for r in loaded] == [[0], [1, 0], [2, 0], [3, 0]]
        else:
            assert [r["rank_reads"] for r in loaded] == [[0], [1], [2], [3]]
    # 11 rows on 4 ranks are rows 0-3, 3-6, 6-9, 9-11; on 2 ranks 0-6 and 6-11.
    loaded = _run("load", 2, tmp_path / "replicated", "replicated")
    assert [(r["step"], r["same"]) for r in loaded] == [(2, True)] * 2
    assert [sorted(r["rank_reads"]) for r in loaded] == [[0, 1], [0, 2, 3]]


def test_a_block_the_first_guess_misses_reads_every_object(tmp_path, caplog):
    """Rank 1 of 4 asks for rows that ranks 0 and 1 hold (not its own share): the
    objects read first (its own, then rank 0's) do not cover them, so it reads every
    object, says why at debug level, and the entry it returns covers the block."""
    root = tmp_path / "ckpt"
    _run("save", 4, root, "sharded")
    manifest = CheckpointStore(root).latest()
    store = CheckpointStore(root)
    reads = RankReads(store._backend, manifest, 1, 4)
    own = reads.tensors.covering("g", (3, 0), (3, 3))  # rank 1's rows: its object only
    assert own is not None and reads.read == [1]
    with caplog.at_level(logging.DEBUG, logger="checkpoint_store"):
        entry = reads.tensors.covering("g", (2, 0), (5, 3))  # rows 2-7: ranks 0, 1, 2
    assert entry is not None and reads.read == [0, 1, 2, 3]
    assert sorted(tuple(s["offsets"]) for s in entry["shards"]) == \
        [(0, 0), (3, 0), (6, 0), (9, 0)]
    assert [r.getMessage() for r in caplog.records if "reads all 4" in r.getMessage()] \
        == [f"rank 1 reads all 4 rank objects of {manifest.name}: the block of 'g' at "
            "(2, 0) of shape (5, 3) is not covered in those of ranks [0, 1]"]
    # The whole index agrees with what every object gives (the listings' view).
    assert entry == manifest.tensors["g"]
    got = torch.zeros(5, 3, dtype=torch.float64)
    store.load({"g": Shard(got, (11, 3), (2, 0))}, keys=["g"], strict=True)
    assert torch.equal(got, (torch.arange(33, dtype=torch.float64).reshape(11, 3) * 7 + 2)[2:7])
