"""Round trips: every dtype and shape bit-exact on file://, memory:// and s3://,
modules and optimizers in place, plain values, and a plain zarr + json reader."""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from checkpoint_store import (
    CheckpointStore,
    NoCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from checkpoint_store.dtypes import dtype_from_name
from tests._ckpt_helpers import (
    SHAPES,
    SUPPORTED_DTYPES,
    random_tensor,
    same_bits,
    zeroed,
)


def _all_dtypes_state() -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(SUPPORTED_DTYPES):
        for j, shape in enumerate(SHAPES):
            state[f"{dtype}.{j}"] = random_tensor(dtype, shape, seed=i * 100 + j)
        # Non-contiguous: a transposed view, and one big enough for its own array.
        state[f"{dtype}.t"] = random_tensor(dtype, (5, 3), seed=i * 100 + 50).t()
        state[f"{dtype}.big"] = random_tensor(dtype, (40, 9), seed=i * 100 + 60)[:, ::2]
    return state


def _store_url(backend: str, tmp_path: Path, request) -> tuple[str, dict | None]:
    if backend == "file":
        return f"file://{tmp_path}/ckpt", None
    if backend == "memory":
        return f"memory://rt-{uuid.uuid4().hex}", None
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", request.getfixturevalue("moto_server").storage_options()


@pytest.mark.parametrize("backend", ["file", "memory", "s3"])
def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path, request, backend):
    """Each supported dtype in 0-d, empty, 1-3-d and non-contiguous shapes comes back
    with the same dtype, shape and bits, both into fresh keys and in place; chunk
    size 256 B makes the larger tensors own arrays of several chunks."""
    url, opts = _store_url(backend, tmp_path, request)
    store = CheckpointStore(url, storage_options=opts, chunk_bytes=256)
    saved = _all_dtypes_state()
    store.save(saved, step=1)

    fresh: dict[str, object] = {}
    manifest = store.load(fresh, keys=list(saved))
    assert manifest is not None and manifest.step == 1
    mismatched = [k for k, v in saved.items() if not same_bits(v, fresh[k])]
    assert mismatched == []

    in_place = {k: zeroed(v) for k, v in saved.items()}
    targets = dict(in_place)
    store.load(in_place)
    assert all(in_place[k] is targets[k] for k in saved)
    assert [k for k, v in saved.items() if not same_bits(v, in_place[k])] == []
    assert len(store.verify(1).arrays) > 1
    store.close()


def test_modules_optimizers_and_plain_values_load_in_place(tmp_path):
    """A model, its Adam state, Python/numpy RNG states, tuples, bytes, big ints and
    nested containers: tensors are copied into the existing parameters, the optimizer
    gets load_state_dict, plain values in the dict are replaced."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    rng = np.random.default_rng(7)
    state = {
        "model": model, "optim": opt, "step": 100, "loss": float("nan"),
        "py_rng": random.getstate(), "np_rng": rng.bit_generator.state,
        "np_legacy": np.random.RandomState(3).get_state(), "torch_rng": torch.get_rng_state(),
        "misc": {"tags": ["a", "b"], "blob": b"\x00\xff", "flag": True, "none": None,
                 1: (2, 3.5), "huge": 2**100, "f32": np.float32(1.5), "arr": np.eye(2)},
    }
    store = CheckpointStore(tmp_path / "c")
    store.save(state, step=100, extra={"offsets": {"p0": "1-5"}})

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    weight = model2[0].weight
    target = {"model": model2, "optim": opt2, "step": 0}
    manifest = store.load(target, keys=list(state))
    assert manifest is not None and manifest.extra == {"offsets": {"p0": "1-5"}}
    assert model2[0].weight is weight
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 model2.state_dict().values()))
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])
    assert target["step"] == 100 and np.isnan(target["loss"])
    assert target["py_rng"] == random.getstate()
    random.setstate(target["py_rng"])
    assert target["np_rng"] == rng.bit_generator.state
    legacy = target["np_legacy"]
    assert legacy[0] == "MT19937" and np.array_equal(legacy[1], np.random.RandomState(3).get_state()[1])
    assert torch.equal(target["torch_rng"], state["torch_rng"])
    misc = target["misc"]
    assert misc["tags"] == ["a", "b"] and misc["blob"] == b"\x00\xff" and misc["flag"] is True
    assert misc["none"] is None and misc[1] == (2, 3.5) and misc["huge"] == 2**100
    assert misc["f32"] == np.float32(1.5) and type(misc["f32"]) is np.float32
    assert np.array_equal(misc["arr"], np.eye(2))


def test_plain_zarr_and_json_read_every_tensor(tmp_path):
    """Without trainguard code: json reads the manifest, zarr opens each array (its
    crc32c codec verifies the chunk) and slicing by the index gives every tensor."""
    saved = _all_dtypes_state()
    store = CheckpointStore(f"file://{tmp_path}/c", chunk_bytes=256)
    manifest = store.save(saved, step=3).wait()

    root = tmp_path / "c"
    doc = json.loads((root / "manifests" / manifest.name).read_text())
    group = zarr.open_group(str(root / "data" / doc["uid"]), mode="r")
    for key, entry in doc["tensors"].items():
        (shard,) = entry["shards"]
        dtype = dtype_from_name(entry["dtype"])
        if shard["nbytes"] == 0:
            got = torch.empty(entry["shape"], dtype=dtype)
        else:
            arr = group[shard["array"]]
            flat = np.ascontiguousarray(arr[...]).reshape(-1).view(np.uint8)
            raw = flat[shard["offset"] : shard["offset"] + shard["nbytes"]].copy()
            got = torch.from_numpy(raw).view(dtype).reshape(entry["shape"])
        assert same_bits(saved[key], got), key
    big = group["r0/t0"]
    assert big.attrs["torch_dtype"] in {str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES}
    assert big.metadata.codecs[-1].to_dict() == {"name": "crc32c"}


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_unsupported_values_name_their_key_path(tmp_path):
    """No pickle fallback: an arbitrary object, a set or a quantized tensor raises
    UnsupportedValueError (a TypeError) naming where it is; nothing is written."""
    store = CheckpointStore(tmp_path / "c")
    cases = {
        "opt/state/0/fn": {"opt": {"state": {0: {"fn": object()}}}},
        "meta/s": {"meta": {"s": {1, 2}}},
        "q": {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
        "objs": {"objs": np.array([object()], dtype=object)},
    }
    for path, state in cases.items():
        with pytest.raises(TypeError, match=path) as info:
            store.save(state, step=1)
        assert isinstance(info.value, UnsupportedValueError)
    with pytest.raises(TypeError, match="extra"):
        store.save({"x": 1}, step=1, extra={"bad": object()})
    with pytest.raises(TypeError, match="str keys"):
        store.save({"x": 1}, step=1, extra={"offsets": {0: "1-5"}})
    assert store.list() == [] and store.latest() is None


def test_mismatched_state_is_refused_before_anything_changes(tmp_path):
    """Missing keys, a module with other parameters and a wrong shape raise
    StateMismatchError listing them; the target tensors keep their values."""
    store = CheckpointStore(tmp_path / "c")
    store.save({"model": torch.nn.Linear(2, 2), "x": torch.ones(3)}, step=1)
    x = torch.zeros(3)
    with pytest.raises(StateMismatchError, match=r"\['nope'\]"):
        store.load({"x": x, "nope": 1})
    with pytest.raises(StateMismatchError, match=r"missing keys.*unexpected keys"):
        store.load({"model": torch.nn.Linear(2, 3, bias=False)})
    with pytest.raises(StateMismatchError, match=r"float32 \(4,\)"):
        store.load({"x": torch.zeros(4)})
    assert torch.equal(x, torch.zeros(3))


def test_empty_store_and_unknown_step(tmp_path):
    """load on an empty store returns None; asking for a step that was never saved
    raises NoCheckpointError (a FileNotFoundError)."""
    store = CheckpointStore(str(tmp_path / "c"))
    assert store.load({"x": torch.zeros(1)}) is None
    assert store.latest() is None and store.list() == []
    store.save({"x": torch.ones(1)}, step=4)
    with pytest.raises(FileNotFoundError):
        store.load({"x": torch.zeros(1)}, step=5)
    with pytest.raises(NoCheckpointError):
        store.verify(5)


@pytest.mark.parametrize("backend", ["file", "memory", "s3"])
def test_manifest_create_is_exclusive(tmp_path, request, backend):
    """The commit primitive refuses to replace an existing manifest on every backend
    (on S3 through If-None-Match, enforced by the moto server); the first stays."""
    url, opts = _store_url(backend, tmp_path, request)
    store = CheckpointStore(url, storage_options=opts)
    backend_ = store._backend
    backend_.exclusive_create("manifests/x.json", b"first")
    with pytest.raises(FileExistsError):
        backend_.exclusive_create("manifests/x.json", b"second")
    assert backend_.read("manifests/x.json") == b"first"
