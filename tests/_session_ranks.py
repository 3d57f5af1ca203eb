"""A two-rank loop for tests/test_session_ranks.py (run once per rank, gloo on CPU).

Every rank trains the same Linear (DDP-like: seeded alike, stepped on the same
gradient-free update) and also holds ``note``: its own rank with ``--diverge``, else
0. It iterates ``session.batches(loader, uneven=MODE)``, checkpoints at the end and
prints ``STEPS <loop iterations> RECORDS <records it consumed> IDS <id,id,...>``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from trainer_client import TrainingSession


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--mode", default="join")
    ap.add_argument("--diverge", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    session = TrainingSession(args.redis, dataset="tok", run="exp", store=args.store,
                              rank=rank, world_size=world, block_ms=100)
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(4, 1), "note": {"value": rank if args.diverge else 0}}
    step = session.restore(state)
    records: list[int] = []
    for batch in session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None),
                                 uneven=args.mode):
        if len(batch):
            records += batch.data[:, 0].tolist()
        step += 1
    session.checkpoint(state, step, blocking=True)
    session.close()
    print(f"STEPS {step} RECORDS {len(records)} IDS {','.join(map(str, records))}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
