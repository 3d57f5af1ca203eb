"""Loads that read large tensors in place: exactly the saved bits, and never a mix.

A default load reads each large tensor's chunks straight into the caller's tensor and
verifies them there, so a damaged chunk is found after part of the checkpoint is
already in the state. These tests damage the *last* chunk read (so earlier chunks and
tensors did land) and prove that the load still returns a state that is entirely one
checkpoint: the fallback reloads every tensor from the previous one. Strict loads,
``step=`` loads and the oldest checkpoint verify first and leave the state untouched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, CorruptCheckpointError
from checkpoint_store.direct import DirectLoad
from checkpoint_store.flatten import decode_skeleton
from checkpoint_store.layout import data_dir
from checkpoint_store.loading import Applier
from checkpoint_store.reader import ChunkReader
from tests._ckpt_helpers import bits, random_tensor, same_bits, zeroed

CHUNK = 256 << 10  # large tensors span several chunks; the last one is padded


def big_state(step: int) -> dict[str, object]:
    """Two tensors of their own arrays (several chunks), a small packed one, a module,
    a plain value: each depends on ``step``."""
    g = torch.Generator().manual_seed(step)
    lin = torch.nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(4, 4, generator=g))
        lin.bias.copy_(torch.randn(4, generator=g))
    return {
        "a": torch.randn(600, 500, generator=g),  # 1.2 MB: 5 chunks, the last padded
        "b": random_tensor(torch.bfloat16, (1024, 700), seed=step),
        "small": torch.randn(10, generator=g),
        "lin": lin,
        "step": step,
    }


def empty_like_state() -> dict[str, object]:
    like = big_state(0)
    out: dict[str, object] = {k: zeroed(v) for k, v in like.items() if isinstance(v, torch.Tensor)}
    lin = torch.nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.zero_()
    out["lin"] = lin
    out["step"] = -1
    return out


def assert_is(state: dict[str, object], step: int) -> None:
    """Every value of ``state`` is exactly checkpoint ``step``'s."""
    want = big_state(step)
    for k in ("a", "b", "small"):
        assert same_bits(state[k], want[k]), k  # type: ignore[arg-type]
    assert torch.equal(state["lin"].weight, want["lin"].weight)  # type: ignore[union-attr]
    assert torch.equal(state["lin"].bias, want["lin"].bias)  # type: ignore[union-attr]
    assert state["step"] == step


def assert_untouched(state: dict[str, object]) -> None:
    for k in ("a", "b", "small"):
        assert not bits(state[k]).any(), k  # type: ignore[arg-type]
    assert state["step"] == -1


def saved(tmp_path: Path, steps: int) -> tuple[CheckpointStore, Path]:
    root = tmp_path / "ckpt"
    store = CheckpointStore(root, chunk_bytes=CHUNK, keep_last=10)
    for s in range(1, steps + 1):
        store.save(big_state(s), step=s)
    return store, root


def last_chunk_of_b(store: CheckpointStore, root: Path, step: int) -> Path:
    """The last chunk file of tensor ``b`` in ``step``'s checkpoint: read after every
    chunk of ``a`` and most of ``b`` (when read in place, those already landed)."""
    m = next(m for m in store.list() if m.step == step)
    array = m.tensors["b"]["shards"][0]["array"]
    files = sorted((root / "data" / m.uid / array).glob("[0-9]*"), key=lambda p: int(p.name.split(".")[0]))
    return files[-1]


def damage(path: Path, how: str, donor: Path | None = None) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip-payload":
        data[5] ^= 0x01
    elif how == "flip-padding":
        data[-5] ^= 0x01  # the last chunk's zero padding, just before the CRC
    elif how == "flip-crc":
        data[-1] ^= 0x01
    elif how == "truncate":
        del data[-100:]
    elif how == "foreign":
        assert donor is not None  # a valid chunk of another save: only the manifest knows
        data = bytearray(donor.read_bytes())
    path.write_bytes(bytes(data))
    if how == "missing":
        path.unlink()


@pytest.mark.parametrize("how", ["flip-payload", "flip-padding", "flip-crc", "truncate",
                                 "missing", "foreign"])
def test_damaged_last_chunk_falls_back_to_one_whole_checkpoint(tmp_path, caplog, how):
    """Step 3's last chunk of ``b`` is damaged: the default load returns step 2 and
    every tensor, module and value is step 2's (nothing of step 3 remains); strict
    load raises and changes nothing."""
    store, root = saved(tmp_path, 3)
    damage(last_chunk_of_b(store, root, 3), how, donor=last_chunk_of_b(store, root, 2))
    state = empty_like_state()
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        manifest = store.load(state)
    assert manifest is not None and manifest.step == 2
    assert_is(state, 2)
    assert "reloading every tensor" in caplog.text
    strict = empty_like_state()
    with pytest.raises(CorruptCheckpointError):
        store.load(strict, strict=True)
    assert_untouched(strict)


def test_two_damaged_checkpoints_fall_back_to_the_third(tmp_path):
    """Steps 4 and 3 damaged: the load returns step 2, whole."""
    store, root = saved(tmp_path, 4)
    damage(last_chunk_of_b(store, root, 4), "flip-payload")
    damage(last_chunk_of_b(store, root, 3), "flip-payload")
    state = empty_like_state()
    assert store.load(state).step == 2
    assert_is(state, 2)


def test_damaged_only_checkpoint_and_step_loads_leave_the_state_untouched(tmp_path):
    """No earlier checkpoint to fall back to (the only one, or ``step=``): the load
    verifies before changing anything, so its error leaves the state as it was."""
    store, root = saved(tmp_path, 2)
    damage(last_chunk_of_b(store, root, 2), "flip-payload")
    by_step = empty_like_state()
    with pytest.raises(CorruptCheckpointError):
        store.load(by_step, step=2)
    assert_untouched(by_step)
    damage(last_chunk_of_b(store, root, 1), "flip-payload")
    state = empty_like_state()
    with pytest.raises(CorruptCheckpointError, match="no loadable checkpoint") as err:
        store.load(state)
    # Step 2 was read in place before its damage showed, and step 1 could not replace
    # it: the error says the state must be rebuilt.
    assert "rebuild the state" in str(err.value)


def test_in_place_load_is_bit_exact_and_bumps_autograd_versions(tmp_path):
    """An intact newest checkpoint loads exactly, large tensors in place (their
    storage is the caller's), and autograd sees them changed as after ``copy_``."""
    store, _ = saved(tmp_path, 2)
    state = empty_like_state()
    a = state["a"]
    ptr, version = a.data_ptr(), a._version  # type: ignore[union-attr]
    assert store.load(state).step == 2
    assert_is(state, 2)
    assert state["a"] is a and a.data_ptr() == ptr  # type: ignore[union-attr]
    assert a._version > version  # type: ignore[union-attr]


def _claims(store: CheckpointStore, root: Path, state: dict[str, object]) -> set[str]:
    m = store.list()[-1]
    reader = ChunkReader(store._backend, data_dir(m.uid), m.arrays, io_threads=2)
    direct = DirectLoad(store._backend, data_dir(m.uid), m.arrays, io_threads=2)
    applier = Applier(m.name, m.tensors, reader, direct)
    applier.prepare(state, decode_skeleton(m.state), None)
    return applier.claimed


def test_only_tensors_that_own_their_memory_are_read_in_place(tmp_path):
    """Contiguous tensors owning their storage are claimed, packed ones included; a
    transposed view and a second alias of a claimed storage go through the staged
    path (and still load exactly)."""
    store, root = saved(tmp_path, 2)
    state = empty_like_state()
    assert set(_claims(store, root, state)) == {"a", "b", "small", "lin/weight", "lin/bias"}
    base = torch.zeros(500, 600)
    alias = empty_like_state()
    alias["a"] = base.t()  # non-contiguous view
    assert "a" not in _claims(store, root, alias)
    shared = torch.zeros(600, 500)
    tied = {"x": shared, "y": shared}
    store.save({"x": torch.full((600, 500), 3.0), "y": torch.full((600, 500), 3.0)}, step=3)
    assert set(_claims(store, root, tied)) == {"x"}
    assert store.load(tied).step == 3 and bool((shared == 3.0).all())
    store.delete(3)
    assert store.load(alias).step == 2
    assert torch.equal(alias["a"], big_state(2)["a"])  # type: ignore[arg-type]


def test_memory_backend_reads_in_place_and_falls_back(tmp_path):
    """The fsspec path (memory://) honours the same promise."""
    store = CheckpointStore(f"memory://direct-{tmp_path.name}", chunk_bytes=CHUNK, keep_last=5)
    for s in (1, 2):
        store.save(big_state(s), step=s)
    state = empty_like_state()
    assert store.load(state).step == 2
    assert_is(state, 2)
    m = store.list()[-1]
    array = m.tensors["b"]["shards"][0]["array"]
    fs = store._backend.fs  # type: ignore[attr-defined]
    root = store._backend.root  # type: ignore[attr-defined]
    chunks = sorted(fs.ls(f"{root}/data/{m.uid}/{array}", detail=False))
    last = max((c for c in chunks if c.rsplit("/", 1)[-1][0].isdigit()),
               key=lambda c: int(c.rsplit("/", 1)[-1].split(".")[0]))
    data = bytearray(fs.cat_file(last))
    data[3] ^= 0x01
    fs.pipe_file(last, bytes(data))
    state = empty_like_state()
    assert store.load(state).step == 1
    assert_is(state, 1)
