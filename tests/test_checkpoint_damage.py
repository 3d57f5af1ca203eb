"""Damage detection: a flipped byte, a truncated or missing chunk, a corrupt manifest
or LATEST is detected; load falls back to the previous checkpoint with a warning,
strict load raises CorruptCheckpointError without touching the state."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, CorruptCheckpointError
from tests._ckpt_helpers import empty_state, state_for

CHUNK = 4096


def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, Path, str]:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, chunk_bytes=CHUNK)
    store.save(state_for(1, width=64), step=1)
    m2 = store.save(state_for(2, width=64), step=2).wait()
    return store, root, m2.name


def _chunk_files(root: Path, uid: str) -> list[Path]:
    return sorted(p for p in (root / "data" / uid).rglob("*")
                  if p.is_file() and p.name != "zarr.json")


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _check_fallback(store: CheckpointStore, caplog, damaged: str) -> None:
    target = empty_state(width=64)
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        manifest = store.load(target)
    assert manifest is not None and manifest.step == 1
    assert torch.equal(target["w"], state_for(1, width=64)["w"]) and target["step"] == 1
    assert damaged in caplog.text
    strict_target = empty_state(width=64)
    with pytest.raises(CorruptCheckpointError, match=damaged):
        store.load(strict_target, strict=True)
    assert torch.equal(strict_target["w"], torch.zeros(64, 64)) and strict_target["step"] == -1


def _damage_chunk(tmp_path: Path, how: str) -> tuple[CheckpointStore, str]:
    store, root, name = _two_checkpoints(tmp_path)
    uid = store.latest().uid
    chunk = _chunk_files(root, uid)[1]
    if how == "flip":
        _flip_byte(chunk, 10)
    elif how == "flip-crc":
        _flip_byte(chunk, chunk.stat().st_size - 1)
    elif how == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:-100])
    else:
        chunk.unlink()
    return store, name


@pytest.mark.parametrize("how", ["flip", "flip-crc", "truncate", "missing"])
def test_damaged_chunk_is_detected_and_skipped(tmp_path, caplog, how):
    """One damaged chunk file of step 2: load falls back to step 1 and logs it,
    strict load raises before changing anything, verify(2) raises, verify(1) passes."""
    store, name = _damage_chunk(tmp_path, how)
    _check_fallback(store, caplog, name)
    with pytest.raises(CorruptCheckpointError):
        store.verify(2)
    assert store.verify(1).step == 1


def test_corrupt_manifest_is_skipped(tmp_path, caplog):
    """A byte flipped in step 2's manifest breaks its checksum: latest() and list()
    skip it, load falls back, strict raises."""
    store, root, name = _two_checkpoints(tmp_path)
    path = root / "manifests" / name
    text = path.read_bytes()
    path.write_bytes(text.replace(b'"step":2', b'"step":3'))
    assert store.latest().step == 1
    assert [m.step for m in store.list()] == [1]
    _check_fallback(store, caplog, name)


def test_truncated_manifest_is_skipped(tmp_path, caplog):
    """A manifest cut in half (not valid JSON) is skipped the same way."""
    store, root, name = _two_checkpoints(tmp_path)
    path = root / "manifests" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _check_fallback(store, caplog, name)


@pytest.mark.parametrize("content", [b'{"manifest": "000000000002-zz', b"\x00garbage",
                                     b'{"manifest": "000000000009-0000000000000000-00000000'
                                     b'.json", "step": 9, "uid": "0000000000000000-00000000"}'])
def test_corrupt_latest_is_detected_and_ignored(tmp_path, caplog, content):
    """LATEST is a hint: when unreadable or inconsistent, load says so and uses the
    manifest listing (step 2 is intact and loads); strict load raises."""
    store, root, _ = _two_checkpoints(tmp_path)
    (root / "LATEST").write_bytes(content)
    target = empty_state(width=64)
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        assert store.load(target).step == 2
    assert "LATEST" in caplog.text and target["step"] == 2
    with pytest.raises(CorruptCheckpointError, match="LATEST"):
        store.load(empty_state(width=64), strict=True)


def test_every_checkpoint_damaged_raises(tmp_path):
    """With no intact checkpoint left, load raises instead of returning None."""
    store, root, _ = _two_checkpoints(tmp_path)
    for m in store.list():
        _flip_byte(_chunk_files(root, m.uid)[0], 0)
    with pytest.raises(CorruptCheckpointError, match="no loadable checkpoint"):
        store.load(empty_state(width=64))
