"""In-place loads of blocks: ``Shard`` targets (the blocks a DTensor's local shard
is) filled straight from another layout's saved blocks, exactly and never a mix.

Two gloo ranks save a tensor as uneven row blocks (rows 0-19 and 19-37, chunks of 10
rows, so blocks end inside chunks); this process then loads the blocks every rank of
other layouts would hold (4 ranks: 10/10/10/7 rows, 3 ranks, one process), one
``Shard`` target at a time. Blocks that take whole rows of the saved ones are read in
place, including chunks only partly needed (read whole, so their CRC is checked);
column blocks take the staged path. Damage (a chunk's CRC, an array's zarr.json)
falls back to the previous checkpoint whole; strict loads raise and change nothing.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_store import CheckpointStore, CorruptCheckpointError, Shard
from tests._ckpt_helpers import claimed_in_place as claims
from tests._ckpt_helpers import run_ranks

WORKER = str(Path(__file__).resolve().parent / "_ckpt_dist_worker.py")
ROWS, COLS = 37, 3


def full(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.int64).reshape(ROWS, COLS) * 10 + step


def save_on(root: Path, world: int) -> Path:
    """Steps 1 and 2 saved by ``world`` ranks (``_ckpt_dist_worker.py`` ``rowblocks``)."""
    out = run_ranks(WORKER, "rowblocks", world, str(root))
    assert [o["steps"] for o in out] == [[1, 2]] * world
    return root


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_on(tmp_path_factory.mktemp("blocks") / "ckpt", 2)


def store_of(root: Path) -> CheckpointStore:
    return CheckpointStore(root, chunk_bytes=240, keep_last=10)


def row_blocks(world: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of each rank's block under ``torch.chunk`` (FSDP2's split)."""
    out, start = [], 0
    for part in torch.arange(ROWS).chunk(world):
        out.append((start, len(part)))
        start += len(part)
    out += [(ROWS, 0)] * (world - len(out))  # ranks past the end hold empty shards
    return out


@pytest.mark.parametrize("world", [4, 3, 2, 1])
def test_row_blocks_of_any_world_size_load_in_place_bit_exact(saved, world):
    """Each rank's block of a ``world``-rank row split (2->4 with a 10/10/10/7 split,
    2->3, the same layout, 2->1) is read in place and equals the saved rows."""
    store = store_of(saved)
    for first, rows in row_blocks(world):
        target = Shard(torch.full((rows, COLS), -1, dtype=torch.int64), (ROWS, COLS), (first, 0))
        assert claims(store, {"w": target}) == ({"w"} if rows else set())
        manifest = store.load({"w": target}, keys=["w"])
        assert manifest is not None and manifest.step == 2
        assert torch.equal(target.tensor, full(2)[first : first + rows])


@pytest.mark.slow
def test_four_rank_blocks_load_in_place_on_two(tmp_path):
    """4->2: saved as 10/10/10/7 rows by 4 ranks, each 2-rank block (19 and 18 rows)
    spans saved blocks and ends inside a chunk; both are read in place, exactly."""
    store = store_of(save_on(tmp_path / "ckpt", 4))
    for first, rows in row_blocks(2):
        target = Shard(torch.full((rows, COLS), -1, dtype=torch.int64), (ROWS, COLS), (first, 0))
        assert claims(store, {"w": target}) == {"w"}
        assert store.load({"w": target}, keys=["w"]).step == 2
        assert torch.equal(target.tensor, full(2)[first : first + rows])


def test_empty_and_column_blocks_take_the_staged_path_exactly(saved):
    """An empty block needs no bytes; a block of columns is not contiguous in the
    saved rows, so it is copied from verified chunks instead; both load exactly."""
    store = store_of(saved)
    empty = Shard(torch.empty(0, COLS, dtype=torch.int64), (ROWS, COLS), (ROWS, 0))
    cols = Shard(torch.zeros(30, 2, dtype=torch.int64), (ROWS, COLS), (5, 1))
    assert claims(store, {"w": empty}) == set()
    assert claims(store, {"w": cols}) == set()
    store.load({"w": cols}, keys=["w"])
    assert torch.equal(cols.tensor, full(2)[5:35, 1:])
    assert store.load({"w": empty}, keys=["w"]) is not None


def newest_array_file(root: Path, store: CheckpointStore, rank: int, name: str) -> Path:
    m = store.list()[-1]
    array = next(s["array"] for s in m.tensors["w"]["shards"] if s["array"].startswith(f"r{rank}/"))
    folder = root / "data" / m.uid / array
    if name == "zarr.json":
        return folder / name
    return max((p for p in folder.iterdir() if p.name[0].isdigit()),
               key=lambda p: int(p.name.split(".")[0]))


@pytest.mark.parametrize("what", ["chunk", "zarr.json"])
def test_damage_falls_back_whole_and_strict_changes_nothing(saved, tmp_path, caplog, what):
    """Step 2's rank-1 block is damaged (its last chunk, partly needed by the middle
    block; or its zarr.json): the default load of a block spanning both saved blocks
    gives step 1's rows, every one of them; a strict load raises and the target keeps
    its bytes."""
    root = tmp_path / "copy"
    shutil.copytree(saved, root)
    store = store_of(root)
    path = newest_array_file(root, store, 1, what)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    target = Shard(torch.full((25, COLS), -1, dtype=torch.int64), (ROWS, COLS), (10, 0))
    assert claims(store, {"w": target}) == {"w"}
    with caplog.at_level(logging.WARNING, logger="checkpoint_store"):
        manifest = store.load({"w": target}, keys=["w"])
    assert manifest is not None and manifest.step == 1
    assert torch.equal(target.tensor, full(1)[10:35])
    assert "reloading every tensor" in caplog.text
    strict = Shard(torch.full((25, COLS), -1, dtype=torch.int64), (ROWS, COLS), (10, 0))
    with pytest.raises(CorruptCheckpointError):
        store.load({"w": strict}, keys=["w"], strict=True)
    assert bool((strict.tensor == -1).all())
