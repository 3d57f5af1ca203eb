"""One rank of a gloo job that counts what its store's collectives bring it.

usage: python tests/_ckpt_bytes_worker.py bytes RANK WORLD PORT ROOT
Saves two checkpoints of ``T`` row-sharded tensors (T = 2, then T = 40; the same bytes
per rank), the store's real gloo communicator wrapped so every payload this rank
receives from another rank is recorded. Prints one JSON line per rank: for each T, the
bytes received per collective and the payloads' markers of other ranks' tensor
entries (array names ``"r<k>/``, ``"shards"``, ``"crc32c"``) found in them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from checkpoint_store import CheckpointStore, Shard

ROWS = 6  # 2 rows a rank on 3 ranks
SIZES = {2: 40, 40: 2}  # tensors -> columns: 640 tensor bytes a rank either way


def state_of(tensors: int, rank: int, world: int) -> dict[str, Any]:
    cols = SIZES[tensors]
    rows = ROWS // world
    out: dict[str, Any] = {}
    for k in range(tensors):
        full = torch.arange(ROWS * cols, dtype=torch.float32).view(ROWS, cols) + k
        out[f"t{k}"] = Shard(full[rank * rows:(rank + 1) * rows].clone(), (ROWS, cols),
                             (rank * rows, 0))
    return out


class Counting:
    """The store's gloo communicator, recording what this rank receives."""

    def __init__(self, inner: Any):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.got: dict[str, int] = {}
        self.payloads: list[bytes] = []

    def _add(self, kind: str, pieces: list[bytes]) -> None:
        self.got[kind] = self.got.get(kind, 0) + sum(map(len, pieces))
        self.payloads += pieces

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        out = self.inner.broadcast_bytes(data)
        self._add("broadcast", [] if self.rank == 0 else [out])
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        out = self.inner.all_gather_bytes(data)
        self._add("all_gather", [b for r, b in enumerate(out) if r != self.rank])
        return out

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        out = self.inner.gather_bytes(data)
        self._add("gather", [] if out is None else [b for r, b in enumerate(out) if r])
        return out

    def all_reduce_int64(self, values: list[int], op: str) -> list[int]:
        out = self.inner.all_reduce_int64(values, op)
        self.got["all_reduce"] = self.got.get("all_reduce", 0) + 8 * len(values)
        return out


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    assert mode == "bytes"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = CheckpointStore(root)
    result: dict[str, Any] = {}
    for step, tensors in enumerate(SIZES, start=1):
        comm = store._comm = Counting(store._comm)  # type: ignore[assignment]
        store.save(state_of(tensors, rank, world), step=step).wait()
        marks = [f'"r{k}/' for k in range(world) if k != rank] + ['"shards"', '"crc32c"']
        result[str(tensors)] = {
            "got": comm.got,
            "leaks": sorted({m for m in marks for p in comm.payloads if m.encode() in p}),
        }
        store._comm = comm.inner
    store.close()
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
