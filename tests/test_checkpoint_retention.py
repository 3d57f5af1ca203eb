"""Retention (keep_last, keep_every, pin), delete, commit order with repeated steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, NoCheckpointError, PinnedCheckpointError


def _data_uids(root: Path) -> set[str]:
    return {p.name for p in (root / "data").iterdir()}


def test_keep_last_and_keep_every(tmp_path):
    """keep_last=2, keep_every=5 over steps 1..12 keeps 5, 10, 11, 12; the data of
    every dropped checkpoint is gone and every kept one verifies."""
    root = tmp_path / "c"
    store = CheckpointStore(root, keep_last=2, keep_every=5)
    for step in range(1, 13):
        store.save({"x": torch.full((4,), float(step))}, step=step)
    kept = store.list()
    assert [m.step for m in kept] == [5, 10, 11, 12]
    assert _data_uids(root) == {m.uid for m in kept}
    assert all(store.verify(m.step).step == m.step for m in kept)
    assert store.gc().deleted_checkpoints == []


def test_pin_keeps_forever_and_blocks_delete(tmp_path):
    """A pinned checkpoint survives retention and refuses delete() until unpinned;
    delete removes manifest and data, and LATEST follows the newest remaining."""
    root = tmp_path / "c"
    store = CheckpointStore(root, keep_last=1)
    store.save({"x": torch.zeros(2)}, step=1)
    assert store.pin(1).pinned
    for step in (2, 3, 4):
        store.save({"x": torch.full((2,), float(step))}, step=step)
    listed = store.list()
    assert [(m.step, m.pinned) for m in listed] == [(1, True), (4, False)]
    with pytest.raises(PinnedCheckpointError):
        store.delete(1)
    store.unpin(1)
    assert not store.list()[0].pinned
    store.delete(4)
    assert [m.step for m in store.list()] == [1]
    assert _data_uids(root) == {store.latest().uid}
    assert '"step": 1' in (root / "LATEST").read_text()
    target = {"x": torch.ones(2)}
    assert store.load(target, strict=True).step == 1 and torch.equal(target["x"], torch.zeros(2))
    with pytest.raises(NoCheckpointError):
        store.delete(4)


def test_repeated_step_after_rollback_is_newest(tmp_path):
    """A run that rolled back saves step 10 again after step 11: commit order, not the
    step number, decides which is newest; the parent chain records it."""
    store = CheckpointStore(tmp_path / "c", keep_last=5)
    a = store.save({"x": torch.tensor(1.0)}, step=10).wait()
    b = store.save({"x": torch.tensor(2.0)}, step=11).wait()
    c = store.save({"x": torch.tensor(3.0)}, step=10).wait()
    assert (b.parent, c.parent) == (a.name, b.name)
    assert store.latest().name == c.name
    target = {"x": torch.tensor(0.0)}
    assert store.load(target, strict=True).name == c.name and target["x"].item() == 3.0
    assert store.load(target, step=11).name == b.name and target["x"].item() == 2.0
    assert [m.name for m in store.list()] == [a.name, b.name, c.name]
