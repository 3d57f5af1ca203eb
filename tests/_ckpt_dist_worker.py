"""One rank of a gloo job for the multi-rank checkpoint tests.

usage: python tests/_ckpt_dist_worker.py save|load|rowblocks RANK WORLD PORT ROOT [FAIL_RANK]
Prints one JSON line with the outcome. ``save`` writes step 1 (async), then step 2,
during which rank FAIL_RANK (if given) hits an injected I/O error mid-data. ``load``
restores into blocks of a different decomposition and checks every element.
``rowblocks`` saves steps 1 and 2 of a (37, 3) int64 tensor ``w`` as ``torch.chunk``
row blocks, in chunks of 10 rows (``tests/test_checkpoint_direct_blocks.py``).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from checkpoint_store import CheckpointStore, Shard
from checkpoint_store._faults import FAIL_ENV

ROWS, COLS = 9, 6
HR, HC = 5, 10


def global_g(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) + 1000 * step


def global_h(step: int) -> torch.Tensor:
    return (torch.arange(HR * HC, dtype=torch.int64).reshape(HR, HC) * 7 + step).to(torch.bfloat16)


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    base, rest = divmod(n, parts)
    start = i * base + min(i, rest)
    return start, start + base + (1 if i < rest else 0)


def state(step: int, rank: int, world: int) -> dict[str, object]:
    r0, r1 = split(ROWS, world, rank)
    c0, c1 = split(HC, world, rank)
    return {
        "g": Shard(global_g(step)[r0:r1].clone(), (ROWS, COLS), (r0, 0)),
        "h": Shard(global_h(step)[:, c0:c1].clone(), (HR, HC), (0, c0)),
        "bias": torch.full((3,), float(step)),
        "step": step,
    }


def main() -> None:
    mode, rank, world, port, root = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5]
    fail_rank = int(sys.argv[6]) if len(sys.argv) > 6 else -1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    store = CheckpointStore(root, chunk_bytes=240 if mode == "rowblocks" else 64)
    out: dict[str, object] = {"rank": rank}
    if mode == "rowblocks":
        rows = torch.arange(37).chunk(world)[rank]
        first, n = int(rows[0]), len(rows)
        for step in (1, 2):
            w = torch.arange(37 * 3, dtype=torch.int64).reshape(37, 3) * 10 + step
            store.save({"w": Shard(w[first : first + n].clone(), (37, 3), (first, 0))},
                       step=step)
        out["steps"] = [m.step for m in store.list()]
    elif mode == "save":
        out["step1"] = store.save(state(1, rank, world), step=1, blocking=False).wait().name
        if rank == fail_rank:
            os.environ[FAIL_ENV] = "mid-data"
        try:
            out["step2"] = store.save(state(2, rank, world), step=2).wait().name
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"
        os.environ.pop(FAIL_ENV, None)
        out["steps"] = [m.step for m in store.list()]
        out["world_size"] = store.latest().world_size
    else:
        if world == 1:
            target: dict[str, object] = {"g": torch.zeros(ROWS, COLS),
                                         "h": torch.zeros(HR, HC, dtype=torch.bfloat16),
                                         "bias": torch.zeros(3), "step": 0}
        else:
            target = state(0, rank, world)
            for key in ("g", "h"):
                target[key].tensor.zero_()
        manifest = store.load(target, strict=True)
        step = manifest.step
        expect = state(step, rank, world)
        ok = target["step"] == step and torch.equal(target["bias"], expect["bias"])
        whole = {"g": global_g(step), "h": global_h(step)}
        for key in ("g", "h"):
            if world > 1:
                ok = ok and torch.equal(target[key].tensor, expect[key].tensor)
            else:
                ok = ok and torch.equal(target[key], whole[key])
        out.update(step=step, ok=bool(ok))
    store.close()
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
