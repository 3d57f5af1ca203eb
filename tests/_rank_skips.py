"""One rank of the per-rank state tests (tests/test_rank_skips.py,
tests/test_rank_fencing.py, tests/test_rank_floor.py; gloo on CPU when WORLD_SIZE > 1).

Restores, then ``--commits`` times consumes ``--steps`` batches and checkpoints at
the step reached; with ``--skip`` it reports its first batch of this run as skipped
(consumed, never trained: ``checkpoint(skipped=[...])``), which only this rank knows.
Prints ``SKIPPED <batch id or ->`` and ``LISTS <n>``: how often the session listed
the store from the first checkpoint on (the store's own ``list``, counted); and
``WARNED <n>``: the warnings the session logged (a failed acknowledgement after a
commit is one). A rank that owns no partition (ranks > partitions) steps on empty
batches (``uneven="join"``) and checkpoints with the others."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_client import TrainingSession
from trainer_client.guard import batch_id
from trainguard.core import streams


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--skip", action="store_true")
    ap.add_argument("--commits", type=int, default=1)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    session = TrainingSession(args.redis, dataset="tok", run="exp", store=args.store,
                              rank=rank, world_size=world, block_ms=100)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 1)}
    warned = _Count()
    logging.getLogger("trainer_client").addHandler(warned)
    step = session.restore(state)
    it = iter(session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None)))
    idle = not streams.rank_partitions(session.spec.partitions, world_size=world,
                                       num_workers=0, rank=rank)
    first = next(it)  # every rank steps together (an idle one on empty batches)
    mine = "-" if idle else batch_id(first)
    lists = [0]
    listing = session.store.list

    def counted() -> object:
        lists[0] += 1
        return listing()

    session.store.list = counted  # type: ignore[method-assign]
    for commit in range(args.commits):
        for _ in range(args.steps - (commit == 0)):
            next(it)
        step += args.steps
        session.checkpoint(state, step, blocking=True, skipped=[mine] if args.skip else None)
    session.close()
    print(f"SKIPPED {mine if args.skip else '-'}", flush=True)
    print(f"LISTS {lists[0]}", flush=True)
    print(f"WARNED {warned.n}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
