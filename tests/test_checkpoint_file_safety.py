"""Local checkpoint files are created safely: temp files never follow a planted
symlink nor reuse an existing file, and a manifest's array names cannot point
outside the checkpoint's data directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore
from checkpoint_store.backends import LocalBackend
from checkpoint_store.layout import new_uid
from checkpoint_store.manifest import encode_manifest, parse_manifest
from trainguard.core.checkpoints import CorruptCheckpointError


def test_planted_symlinks_at_temp_names_are_not_followed(tmp_path: Path) -> None:
    """Symlinks planted at the temp names an older version used (``.tmp-<name>.<pid>``)
    for LATEST and for a manifest do not redirect a save: the victim file keeps its
    bytes, and the checkpoint loads."""
    root = tmp_path / "ckpt"
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (root / "manifests").mkdir(parents=True)
    os.symlink(victim, root / f".tmp-LATEST.{os.getpid()}")
    store = CheckpointStore(str(root))
    state = {"w": torch.arange(4, dtype=torch.float32)}
    store.save(state, step=1, blocking=True)
    for name in os.listdir(root / "manifests"):
        os.symlink(victim, root / "manifests" / f".tmp-{name}.{os.getpid()}")
    store.save(state, step=2, blocking=True)
    assert victim.read_bytes() == b"precious"
    into = {"w": torch.zeros(4)}
    store.load(into)
    assert torch.equal(into["w"], state["w"])
    store.close()


def test_temp_file_creation_refuses_an_existing_path(tmp_path: Path) -> None:
    """The backend's create never writes through a symlink placed at the final name of
    a data file (exclusive, no-follow create)."""
    backend = LocalBackend(str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, tmp_path / "chunk")
    with pytest.raises(OSError):
        backend.write_file("chunk", [b"evil"])
    assert victim.read_bytes() == b"precious"


@pytest.mark.parametrize("array", ["../../outside", "/etc/passwd", "a//b", "a/./b", "a\\b"])
def test_manifest_array_names_are_confined_to_the_root(array: str) -> None:
    """A manifest (with a valid checksum) naming an array outside the data directory is
    corrupt."""
    uid = new_uid()
    raw = encode_manifest(step=3, uid=uid, created_at=0.0, parent=None, world_size=1,
                          extra={}, arrays={array: {}}, tensors={}, state=b"")
    with pytest.raises(CorruptCheckpointError, match="not a relative path"):
        parse_manifest(f"{3:012d}-{uid}.json", raw)
