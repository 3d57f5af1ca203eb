"""FORMAT.md's reader, run verbatim: the Python block of "Reading a checkpoint without
trainguard" reads a multi-rank sharded checkpoint and a DTensor one from local,
memory:// and S3 (moto) roots, every tensor and plain value equal to what trainguard
itself loads, bit for bit; a damaged manifest is passed over, as the format says."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

import checkpoint_store
from checkpoint_store import CheckpointStore
from checkpoint_store.flatten import TensorRef, decode_skeleton
from tests._ckpt_helpers import bits, run_ranks

TESTS = Path(__file__).resolve().parent
FORMAT_MD = Path(checkpoint_store.__file__).with_name("FORMAT.md")


def _reader() -> dict[str, Any]:
    text = FORMAT_MD.read_text()
    section = text.split("## Reading a checkpoint without trainguard", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    namespace: dict[str, Any] = {"__name__": "format_reader"}
    exec(compile(blocks[0], str(FORMAT_MD), "exec"), namespace)  # the spec's own code
    return namespace


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A 2-rank Shard checkpoint (row blocks, uneven bfloat16 column blocks, plain
    values; two commits) and a 2-rank DTensor one (uneven and empty shards)."""
    base = tmp_path_factory.mktemp("saved")
    run_ranks(str(TESTS / "_ckpt_dist_worker.py"), "save", 2, str(base / "sharded"))
    run_ranks(str(TESTS / "_ckpt_fsdp_worker.py"), "dtensor", 2, str(base / "dtensor"))
    return {"sharded": base / "sharded", "dtensor": base / "dtensor"}


def _copy_to(kind: str, local: Path, request) -> tuple[str, dict[str, Any] | None]:
    if kind == "file":
        return f"file://{local}", None
    if kind == "memory":
        url = f"memory://fmt-{local.name}-{id(request)}"
        fs, opts = fsspec.filesystem("memory"), None
    else:
        bucket = request.getfixturevalue("s3_bucket")
        opts = request.getfixturevalue("moto_server").storage_options()
        url = f"s3://{bucket}/{local.name}"
        fs = fsspec.filesystem("s3", **opts)
    for f in local.rglob("*"):
        if f.is_file():
            fs.pipe_file(f"{url.split('://', 1)[1]}/{f.relative_to(local)}", f.read_bytes())
    return url, opts


@pytest.mark.parametrize("kind", ["file", "memory", "s3"])
@pytest.mark.parametrize("which", ["sharded", "dtensor"])
def test_format_md_reader_reads_what_trainguard_loads(saved, kind, which, request):
    url, opts = _copy_to(kind, saved[which], request)
    spec = _reader()
    fs, path = spec["open_root"](url, opts)
    doc = spec["newest_manifest"](fs, path)
    store = CheckpointStore(url, storage_options=opts)
    latest = store.latest()
    assert latest is not None and doc["uid"] == latest.uid

    skeleton = decode_skeleton(latest.state)
    expected: dict[str, Any] = {}
    store.load(expected, keys=list(skeleton), strict=True)
    assert spec["read_state"](doc) == _as_read(skeleton)
    for key in doc["tensors"]:
        want = _lookup(expected, key)
        got = spec["read_tensor"](fs, path, doc, key)
        assert list(got.shape) == list(want.shape), key
        assert np.ascontiguousarray(got).view(np.uint8).tobytes() == \
            bits(want).numpy().tobytes(), key
        for s in doc["tensors"][key]["shards"]:
            if s["array"]:
                meta = spec["check_zarr_json"](fs, path, doc, s["array"])
                assert meta["shape"] == doc["arrays"][s["array"]]["shape"]


def _as_read(value: Any) -> Any:
    """The skeleton as the reader gives it: ("tensor", key) for each tensor."""
    if isinstance(value, TensorRef):
        return ("tensor", value.path)
    if isinstance(value, dict):
        return {k: _as_read(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_as_read(v) for v in value)
    return value


def _lookup(state: dict[str, Any], key: str) -> torch.Tensor:
    node: Any = state
    for part in key.split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    assert isinstance(node, torch.Tensor)
    return node


def test_format_md_reader_skips_a_damaged_manifest(saved, tmp_path):
    """The newest manifest with one byte changed fails the reader's checksum, which
    then takes the previous checkpoint, as trainguard does."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(saved["sharded"], root)
    names = sorted(p.name for p in (root / "manifests").iterdir())
    assert len(names) == 2
    newest = root / "manifests" / names[-1]
    raw = bytearray(newest.read_bytes())
    raw[10] ^= 1
    newest.write_bytes(bytes(raw))
    spec = _reader()
    fs, path = spec["open_root"](str(root))
    assert spec["newest_manifest"](fs, path)["uid"] == names[0][13:-5]
    assert CheckpointStore(root).load({"bias": torch.zeros(3)}, keys=["bias"]).name == names[0]
