"""A listing re-reads no manifest it verified before: rank 0 lists the store at every
commit (the kept checkpoints it publishes), and a manifest's index grows with the
world size, so a listing that re-read and re-parsed every kept manifest cost O(W)
each time. A manifest is written once; a store trusts the copy it verified (or
committed) while the file's modification time is the one it had then."""

from __future__ import annotations

import os

from checkpoint_store import CheckpointStore
from tests._ckpt_helpers import state_for


def _garble(path, keep_time: bool) -> None:
    """Replace a manifest's bytes with same-length garbage, optionally restoring its
    modification time (what no real writer does: it shows whether a read happened)."""
    st = os.stat(path)
    path.write_bytes(b"x" * st.st_size)
    if keep_time:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_listing_reads_no_manifest_it_committed_or_verified(tmp_path) -> None:
    """Three commits; their manifests garbled in place with their times kept: the
    store that committed them still lists all three with their steps and records
    (it read none of them), while a fresh store, which must read them, finds none."""
    root = tmp_path / "ckpt"
    store = CheckpointStore(root)
    for step in (1, 2, 3):
        store.save(state_for(step, width=8), step=step, extra={"n": step})
    names = [m.name for m in store.list()]
    for name in names:
        _garble(root / "manifests" / name, keep_time=True)
    listed = store.list()
    assert [(m.name, m.step, m.extra) for m in listed] == [
        (n, s, {"n": s}) for n, s in zip(names, (1, 2, 3))]
    assert CheckpointStore(root).list() == []


def test_a_manifest_read_by_a_listing_is_not_read_again(tmp_path) -> None:
    """A store that did not write the checkpoints reads each manifest once: after its
    first listing, garbling them with their times kept changes nothing it lists; a
    rewrite that moves the time (damage) is read again and skipped."""
    root = tmp_path / "ckpt"
    writer = CheckpointStore(root)
    for step in (1, 2):
        writer.save(state_for(step, width=8), step=step)
    reader = CheckpointStore(root)
    names = [m.name for m in reader.list()]
    _garble(root / "manifests" / names[0], keep_time=True)
    assert [m.step for m in reader.list()] == [1, 2]
    _garble(root / "manifests" / names[1], keep_time=False)
    os.utime(root / "manifests" / names[1], ns=(1, 1))  # surely a time not seen before
    assert [m.step for m in reader.list()] == [1]
