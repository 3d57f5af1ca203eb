"""One rank of tests/test_rank_skips.py (gloo on CPU when WORLD_SIZE > 1).

Restores, consumes ``--steps`` batches and checkpoints at the step reached; with
``--skip`` it reports its first batch of this run as skipped (consumed, never
trained: ``checkpoint(skipped=[...])``), which only this rank knows. Prints
``SKIPPED <batch id or ->``."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_client import TrainingSession
from trainer_client.guard import batch_id


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--skip", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    session = TrainingSession(args.redis, dataset="tok", run="exp", store=args.store,
                              rank=rank, world_size=world, block_ms=100)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 1)}
    step = session.restore(state)
    it = iter(session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None)))
    first = next(it)
    for _ in range(args.steps - 1):
        next(it)
    mine = batch_id(first)
    session.checkpoint(state, step + args.steps, blocking=True,
                       skipped=[mine] if args.skip else None)
    session.close()
    print(f"SKIPPED {mine if args.skip else '-'}", flush=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
