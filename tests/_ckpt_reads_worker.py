"""One rank of a gloo job for ``tests/test_checkpoint_rank_reads.py``.

usage: python tests/_ckpt_reads_worker.py save|load RANK WORLD PORT ROOT KIND
Prints one JSON line. ``save`` writes steps 1 and 2 of the state of KIND
(``replicated``: a DTensor ``Shard(0)`` and a ``Shard`` of uneven rows, each rank its
own block, plus a plain tensor only rank 0 writes; ``sharded``: the two sharded ones
only). ``load`` restores the newest checkpoint into this world's blocks through a
store whose backend counts each read of a rank object (``ranks/<r>.json``), and
reports the ranks read and whether every loaded byte equals the saved one.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from checkpoint_store import CheckpointStore
from checkpoint_store import Shard as CkptShard
from checkpoint_store.backends import LocalBackend
from checkpoint_store.rank_state import RANKS_DIR
from tests._ckpt_helpers import same_bits

ROWS, COLS = 11, 3


class CountingBackend(LocalBackend):
    """The local backend, noting the rank of every rank object it reads."""

    def __init__(self, root: str):
        super().__init__(root)
        self.rank_reads: list[int] = []

    def read(self, path: str) -> bytes:
        parent, _, leaf = path.rpartition("/")
        if parent.endswith(f"/{RANKS_DIR}") and leaf.endswith(".json"):
            self.rank_reads.append(int(leaf.removesuffix(".json")))
        return super().read(path)


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    base, rest = divmod(n, parts)
    start = i * base + min(i, rest)
    return start, start + base + (1 if i < rest else 0)


def full(step: int, salt: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float64).reshape(ROWS, COLS) * salt + step


def state(step: int, rank: int, world: int, kind: str) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,))
    r0, r1 = split(ROWS, world, rank)
    out: dict[str, object] = {
        "w": distribute_tensor(full(step, 3), mesh, [Shard(0)]),
        "g": CkptShard(full(step, 7)[r0:r1].clone(), (ROWS, COLS), (r0, 0)),
        "step": step,
    }
    if kind == "replicated":
        out["bias"] = torch.arange(5, dtype=torch.int32) + step
    return out


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    kind = sys.argv[6]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = CheckpointStore(root, chunk_bytes=64)
    out: dict[str, object] = {"rank": rank}
    if mode == "save":
        for step in (1, 2):
            store.save(state(step, rank, world, kind), step=step)
        out["world_size"] = store.latest().world_size
    else:
        counting = CountingBackend(root)
        store._backend = counting  # the store reads through it from here on
        target = state(0, rank, world, kind)
        manifest = store.load(target)  # the default load: local shards read in place
        expect = state(manifest.step, rank, world, kind)
        same = [same_bits(target["w"].to_local(), expect["w"].to_local()),
                same_bits(target["g"].tensor, expect["g"].tensor),
                target["step"] == expect["step"]]
        if kind == "replicated":
            same.append(same_bits(target["bias"], expect["bias"]))
        out.update(step=manifest.step, same=all(same), rank_reads=counting.rank_reads)
    store.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
