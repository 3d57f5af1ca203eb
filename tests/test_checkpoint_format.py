"""Golden test of the on-disk format: pins FORMAT.md (manifest fields, array
metadata, chunk bytes, msgpack skeleton, LATEST) so a change to any of them is a
deliberate format change (bump FORMAT_VERSION and update FORMAT.md)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from pathlib import Path

import crc32c
import pytest
import torch

import checkpoint_store
from checkpoint_store import FORMAT_VERSION, CheckpointStore
from checkpoint_store.manifest import CHECKSUM_SUFFIX_BYTES, MANIFEST_KEYS, SINGLE_RANK_VERSION
from trainguard.core.checkpoints import CorruptCheckpointError

FORMAT_MD = Path(checkpoint_store.__file__).with_name("FORMAT.md")

EXPECTED_BODY = {
    "arrays": {
        "r0/pack": {"chunk_bytes": 4, "chunk_rows": 4, "crc32c": [1387516326],
                    "data_type": "uint8", "shape": [4]},
        "r0/t0": {"chunk_bytes": 160, "chunk_rows": 10, "crc32c": [584263131, 5669496],
                  "data_type": "float32", "shape": [20, 4]},
    },
    "extra": {"offsets": {"p0": "1-7"}},
    "format": "trainguard.checkpoint",
    "nbytes": 324,
    "parent": None,
    "state": {"base64": "g6F31AF3oWLUAWKkc3RlcAM=", "encoding": "msgpack"},
    "step": 3,
    "tensors": {
        "b": {"dtype": "bfloat16", "shape": [2], "shards": [
            {"array": "r0/pack", "nbytes": 4, "offset": 0, "offsets": [0], "shape": [2]}]},
        "w": {"dtype": "float32", "shape": [20, 4], "shards": [
            {"array": "r0/t0", "nbytes": 320, "offset": 0, "offsets": [0, 0],
             "shape": [20, 4]}]},
    },
    "version": 3,
    "world_size": 1,
    "ranks": None,
}

EXPECTED_T0 = {
    "attributes": {"key": "w", "torch_dtype": "float32"},
    "chunk_grid": {"configuration": {"chunk_shape": [10, 4]}, "name": "regular"},
    "chunk_key_encoding": {"configuration": {"separator": "."}, "name": "v2"},
    "codecs": [{"configuration": {"endian": "little"}, "name": "bytes"}, {"name": "crc32c"}],
    "data_type": "float32",
    "fill_value": 0.0,
    "node_type": "array",
    "shape": [20, 4],
    "zarr_format": 3,
}


def _save(root: Path):
    store = CheckpointStore(root, chunk_bytes=256)
    state = {"w": torch.arange(80, dtype=torch.float32).reshape(20, 4),
             "b": torch.ones(2, dtype=torch.bfloat16), "step": 3}
    return store.save(state, step=3, extra={"offsets": {"p0": "1-7"}}).wait()


def test_manifest_bytes_end_with_a_checksum_of_the_bytes_before_it(tmp_path):
    """Exact manifest content (minus uid, time and checksum); the file is compact JSON
    with sorted keys whose last field is the checksum: its last 87 bytes are
    ``,"checksum":"sha256:<hex>"}`` and a newline, the SHA-256 of every byte before
    them. Each array entry carries the SHA-256 of its zarr.json exactly as stored."""
    manifest = _save(tmp_path)
    raw = (tmp_path / "manifests" / manifest.name).read_bytes()
    doc = json.loads(raw)
    assert re.fullmatch(r"000000000003-[0-9a-f]{16}-[0-9a-f]{8}\.json", manifest.name)
    checksum = doc.pop("checksum")
    assert CHECKSUM_SUFFIX_BYTES == 87
    body, suffix = raw[:-87], raw[-87:]
    assert suffix == f',"checksum":"{checksum}"}}\n'.encode()
    assert checksum == "sha256:" + hashlib.sha256(body).hexdigest()
    assert body + b"}" == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert doc.pop("uid") == manifest.uid and isinstance(doc.pop("created_at"), float)
    data = tmp_path / "data" / manifest.uid
    for path, entry in doc["arrays"].items():
        stored = (data / path / "zarr.json").read_bytes()
        assert entry.pop("zarr_json_sha256") == hashlib.sha256(stored).hexdigest()
    assert doc == EXPECTED_BODY
    # Format 4 changed saves of several ranks only; a single-rank save is format 3.
    assert (FORMAT_VERSION, SINGLE_RANK_VERSION) == (4, 3)


def _as_version_1(raw: bytes) -> bytes:
    """A version 2 manifest rewritten the way version 1 stored it: canonical JSON with
    the checksum over Python's canonical form of the other fields."""
    doc = json.loads(raw)
    doc.pop("checksum")
    doc["version"] = 1
    doc.pop("ranks")
    for entry in doc["arrays"].values():
        entry.pop("zarr_json_sha256")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = "sha256:" + hashlib.sha256(canonical).hexdigest()
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def test_version_1_checkpoints_still_load_and_unknown_versions_are_refused(tmp_path):
    """A version 1 manifest (old checksum rule, no zarr.json hashes) loads and
    verifies; a manifest of a version this reader does not know is refused with a
    message naming the version (and a non-strict load falls back past it)."""
    manifest = _save(tmp_path)
    path = tmp_path / "manifests" / manifest.name
    path.write_bytes(_as_version_1(path.read_bytes()))
    store = CheckpointStore(tmp_path)
    target = {"w": torch.zeros(20, 4), "b": torch.zeros(2, dtype=torch.bfloat16), "step": 0}
    assert store.load(target, strict=True).name == manifest.name
    assert torch.equal(target["w"], torch.arange(80, dtype=torch.float32).reshape(20, 4))
    store.verify(3)
    doc = json.loads(path.read_bytes())
    doc["version"] = 5
    path.write_bytes(json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match=r"format version 5; this reader "
                                                     r"understands versions \[1, 2, 3, 4\]"):
        store.load(target, strict=True)


def test_a_damaged_zarr_json_fails_verification(tmp_path):
    """An array's zarr.json whose data_type was changed no longer matches the hash in
    the manifest: verify reports it (a reader trusting it would read wrong values)."""
    manifest = _save(tmp_path)
    meta = tmp_path / "data" / manifest.uid / "r0" / "t0" / "zarr.json"
    meta.write_text(meta.read_text().replace('"float32"', '"int32"'))
    with pytest.raises(CorruptCheckpointError, match=r"r0/t0/zarr\.json does not match"):
        CheckpointStore(tmp_path).verify(3)


def test_zarr_metadata_chunks_and_latest_are_pinned(tmp_path):
    """zarr.json documents, chunk file bytes (payload + little-endian CRC-32C, last
    chunk full size) and LATEST are exactly as FORMAT.md says."""
    manifest = _save(tmp_path)
    data = tmp_path / "data" / manifest.uid
    assert json.loads((data / "zarr.json").read_text()) == {
        "attributes": {"trainguard": {"step": 3, "uid": manifest.uid}},
        "node_type": "group", "zarr_format": 3}
    assert json.loads((data / "r0" / "zarr.json").read_text()) == {
        "attributes": {}, "node_type": "group", "zarr_format": 3}
    assert json.loads((data / "r0" / "t0" / "zarr.json").read_text()) == EXPECTED_T0
    pack_meta = json.loads((data / "r0" / "pack" / "zarr.json").read_text())
    assert pack_meta["attributes"] == {"packed": True} and pack_meta["data_type"] == "uint8"
    assert sorted(p.name for p in (data / "r0" / "t0").iterdir()) == ["0.0", "1.0", "zarr.json"]

    chunk = (data / "r0" / "t0" / "1.0").read_bytes()
    payload = torch.arange(40, 80, dtype=torch.float32).numpy().tobytes()
    assert chunk == payload + struct.pack("<I", crc32c.crc32c(payload))
    pack = (data / "r0" / "pack" / "0").read_bytes()
    assert pack[:4] == bytes([0x80, 0x3F, 0x80, 0x3F])  # bfloat16 1.0, raw little-endian
    assert pack[4:] == struct.pack("<I", crc32c.crc32c(pack[:4]))

    latest = (tmp_path / "LATEST").read_bytes()
    assert latest == (json.dumps({"manifest": manifest.name, "step": 3, "uid": manifest.uid},
                                 sort_keys=True) + "\n").encode()


def test_state_skeleton_extension_types_are_pinned(tmp_path):
    """msgpack skeleton bytes for tensor references, tuples, numpy arrays and scalars
    and big ints are exactly the documented extension types 1-5."""
    import numpy as np

    store = CheckpointStore(tmp_path, chunk_bytes=256)
    state = {"t": torch.zeros(1, dtype=torch.uint8), "tup": (1, "a"),
             "arr": np.array([1, 2], dtype="<i2"), "sc": np.float32(1.0), "big": -(2**64)}
    manifest = store.save(state, step=0).wait()
    skeleton = base64.b64decode(json.loads(
        (tmp_path / "manifests" / manifest.name).read_bytes())["state"]["base64"])
    assert skeleton == bytes.fromhex(
        "85"                                    # map of 5
        "a174" "d40174"                         # "t": ext 1 (fixext1) "t"
        "a3747570" "d602" "9201a161"            # "tup": ext 2 (fixext4) [1, "a"]
        "a3617272" "c70d03" "93a33c6932" "9102" "c404" "01000200"  # "arr": ext 3
        "a27363" "c70b04" "92a33c6634" "c404" "0000803f"           # "sc": ext 4
        "a3626967" "c70905" "ff" "0000000000000000"                # "big": ext 5
    )


def test_bytesio_is_extension_type_6_and_the_format_md_reader_reads_it(tmp_path):
    """An io.BytesIO is stored as extension type 6 holding its bytes, exactly (the
    last row of FORMAT.md's table); the spec's own reader decodes it to those bytes."""
    import io

    from tests.test_checkpoint_format_reader import _reader

    store = CheckpointStore(tmp_path, chunk_bytes=256)
    manifest = store.save({"b": io.BytesIO(b"abc")}, step=0).wait()
    doc = json.loads((tmp_path / "manifests" / manifest.name).read_bytes())
    skeleton = base64.b64decode(doc["state"]["base64"])
    assert skeleton == bytes.fromhex("81" "a162" "c70306" "616263")  # "b": ext 6 (ext8) abc
    assert "| 6 | in-memory binary stream (`io.BytesIO`) |" in FORMAT_MD.read_text()
    read = _reader()["read_state"](doc)
    assert list(read) == ["b"] and read["b"].getvalue() == b"abc"


def test_rank_state_objects_are_pinned_and_checked_against_the_index(tmp_path):
    """A save with rank_state writes data/<uid>/ranks/0.json as canonical JSON of the
    documented fields, the manifest's ``ranks`` index holds the first 32 hex digits of
    its SHA-256, read_rank_state returns the document, and one changed byte in the
    object makes it (and verify) refuse the checkpoint as damaged."""
    store = CheckpointStore(tmp_path)
    m = store.save({"w": torch.ones(2)}, step=4, rank_state={"offsets": {"0": "1-2"}}).wait()
    raw = (tmp_path / "data" / m.uid / "ranks" / "0.json").read_bytes()
    assert raw == json.dumps({
        "format": "trainguard.rank_state", "version": 1, "uid": m.uid, "step": 4,
        "rank": 0, "world_size": 1, "state": {"offsets": {"0": "1-2"}},
    }, sort_keys=True, separators=(",", ":")).encode()
    doc = json.loads((tmp_path / "manifests" / m.name).read_bytes())
    assert doc["ranks"] == {"digest": "sha256/128",
                            "objects": [hashlib.sha256(raw).hexdigest()[:32]]}
    assert store.read_rank_state(m, 0) == {"offsets": {"0": "1-2"}}
    store.verify(4)
    (tmp_path / "data" / m.uid / "ranks" / "0.json").write_bytes(raw.replace(b"1-2", b"1-3"))
    with pytest.raises(CorruptCheckpointError, match=r"rank 0 .* does not match the manifest"):
        store.read_rank_state(m, 0)
    with pytest.raises(CorruptCheckpointError, match="rank 0"):
        store.verify(4)
    with pytest.raises(IndexError, match="rank 1 is not one of the 1 ranks"):
        store.read_rank_state(m, 1)
    store.close()


def test_format_md_documents_every_manifest_field():
    """The manifest field table in FORMAT.md lists exactly the fields written."""
    text = FORMAT_MD.read_text()
    section = text.split("## Manifest", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))
    assert documented == set(MANIFEST_KEYS)
    assert f"format, version {FORMAT_VERSION}" in text.splitlines()[0]
