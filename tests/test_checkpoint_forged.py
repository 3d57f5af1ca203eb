"""Forged or buggy manifests whose checksum holds: each one is damage like any other.
A load falls back to the previous checkpoint (exactly its values), a strict load
raises CorruptCheckpointError, and a symlink planted as a chunk is refused without
telling anything about the file it points to."""

from __future__ import annotations

import base64
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from checkpoint_store import CheckpointStore, CorruptCheckpointError
from checkpoint_store.flatten import EXT_TUPLE
from checkpoint_store.manifest import encode_manifest
from tests._ckpt_helpers import empty_state, state_for

CHUNK = 4096


def _two_checkpoints(tmp_path: Path) -> tuple[CheckpointStore, Path]:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, chunk_bytes=CHUNK)
    store.save(state_for(1, width=64), step=1)
    store.save(state_for(2, width=64), step=2).wait()
    return store, root


def forge(root: Path, step: int, mutate: Callable[[dict[str, Any]], None]) -> str:
    """Rewrite step ``step``'s manifest through ``mutate`` with a valid checksum, as
    a faulty writer would have committed it; returns its name."""
    (path,) = [p for p in (root / "manifests").iterdir()
               if json.loads(p.read_bytes())["step"] == step]
    doc = json.loads(path.read_bytes())
    mutate(doc)
    raw = encode_manifest(
        step=doc["step"], uid=doc["uid"], created_at=doc["created_at"], parent=doc["parent"],
        world_size=doc["world_size"], extra=doc["extra"], arrays=doc["arrays"],
        tensors=doc["tensors"], state=base64.b64decode(doc["state"]["base64"]))
    path.unlink()
    path.write_bytes(raw)
    return path.name


def _pack(doc: dict[str, Any]) -> str:
    return next(a for a in doc["arrays"] if a.endswith("pack"))


def _chunk_bytes_zero(doc: dict[str, Any]) -> None:
    for meta in doc["arrays"].values():
        meta["chunk_bytes"] = 0


def _crc_list_empty(doc: dict[str, Any]) -> None:
    for meta in doc["arrays"].values():
        meta["crc32c"] = []


def _huge_shape(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["shape"] = [10**12]


def _object_dtype(doc: dict[str, Any]) -> None:
    doc["tensors"]["w"]["dtype"] = "object"


def _unknown_data_type(doc: dict[str, Any]) -> None:
    doc["arrays"][_pack(doc)]["data_type"] = "V1000000"


def _shard_outside_array(doc: dict[str, Any]) -> None:
    doc["tensors"]["b"]["shards"][0]["offset"] = 10**9


def _state_of(obj: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["state"]["base64"] = base64.b64encode(msgpack.packb(obj)).decode()
    return mutate


def _nested_tuples(depth: int) -> Any:
    inner = msgpack.packb([1])
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(EXT_TUPLE, inner))
    return msgpack.ExtType(EXT_TUPLE, inner)


FORGERIES: dict[str, Callable[[dict[str, Any]], None]] = {
    "chunk_bytes=0": _chunk_bytes_zero,
    "crc32c=[]": _crc_list_empty,
    "shape=[1e12]": _huge_shape,
    "dtype=object": _object_dtype,
    "data_type=V1000000": _unknown_data_type,
    "shard outside its array": _shard_outside_array,
    # 1.5 million empty lists: 1.5 MB of msgpack, ~100 MB of Python objects (a
    # bomb of 15 MB cost 2 GB); the bound is a million lists and maps.
    "state of many containers": _state_of({"step": 2, "pad": [[]] * 1_500_000}),
    # Each level of an extension value is decoded from a copy of its bytes.
    "state of deeply nested tuples": _state_of({"step": 2, "pad": _nested_tuples(200)}),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_manifest_with_a_valid_checksum_falls_back_to_the_previous_checkpoint(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, forgery: str) -> None:
    """Step 2's manifest rewritten by a faulty writer (valid checksum): load() returns
    step 1 with exactly step 1's values, strict load raises CorruptCheckpointError and
    leaves the state untouched, and the listing skips step 2 (a bad structure is found
    when the manifest is parsed; a bad state skeleton when a load decodes it)."""
    store, root = _two_checkpoints(tmp_path)
    name = forge(root, 2, FORGERIES[forgery])
    target = empty_state(width=64)
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        manifest = store.load(target)
    assert manifest is not None and manifest.step == 1
    assert torch.equal(target["w"], state_for(1, width=64)["w"]) and target["step"] == 1
    assert name in caplog.text
    strict = empty_state(width=64)
    with pytest.raises(CorruptCheckpointError, match=name):
        store.load(strict, strict=True)
    assert torch.equal(strict["w"], torch.zeros(64, 64)) and strict["step"] == -1
    if not forgery.startswith("state"):  # the skeleton is decoded by loads, not listings
        assert [m.step for m in store.list()] == [1]
    store.close()


def test_a_chunk_replaced_by_a_symlink_is_refused_and_reveals_nothing(tmp_path: Path) -> None:
    """A chunk of step 2 replaced by a symlink to another readable file of exactly the
    chunk's size: verify(2) and load refuse it as damage, and no message carries the
    other file's size, its last bytes or its CRC."""
    store, root = _two_checkpoints(tmp_path)
    uid = store.latest().uid
    chunk = sorted(p for p in (root / "data" / uid).rglob("*")
                   if p.is_file() and p.name != "zarr.json")[0]
    secret = tmp_path / "secret.bin"
    payload = os.urandom(chunk.stat().st_size)
    secret.write_bytes(payload)
    chunk.unlink()
    chunk.symlink_to(secret)
    with pytest.raises(CorruptCheckpointError, match="symbolic link") as info:
        store.verify(2)
    text = str(info.value)
    tail = int.from_bytes(payload[-4:], "little")
    for figure in (str(len(payload)), f"{tail:#010x}", f"{tail:08x}", str(tail)):
        assert figure not in text
    target = empty_state(width=64)
    assert store.load(target).step == 1
    assert torch.equal(target["w"], state_for(1, width=64)["w"])
    store.close()


def test_damage_messages_carry_no_byte_values(tmp_path: Path) -> None:
    """A chunk of step 2 overwritten with other bytes of another length: the error
    names the chunk and the kind of damage, and quotes neither size nor CRC."""
    store, root = _two_checkpoints(tmp_path)
    uid = store.latest().uid
    chunk = sorted(p for p in (root / "data" / uid).rglob("*")
                   if p.is_file() and p.name != "zarr.json")[0]
    size = chunk.stat().st_size
    chunk.write_bytes(b"\x07" * (size + 3))
    with pytest.raises(CorruptCheckpointError, match="size") as info:
        store.verify(2)
    assert str(size + 3) not in str(info.value) and str(size) not in str(info.value)
    chunk.write_bytes(b"\x07" * size)
    with pytest.raises(CorruptCheckpointError, match="CRC-32C") as info:
        store.verify(2)
    assert "0x" not in str(info.value)
    store.close()
