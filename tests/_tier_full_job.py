"""One attempt of a ledger job whose local checkpoint tier is a full tmpfs.

usage: python -m tests._tier_full_job REDIS_URL LOCAL_DIR REMOTE_URL RECORDS [--crash-at S]

Run by tests/test_tier_full.py inside a private mount namespace where LOCAL_DIR is a
small tmpfs. The first call fills LOCAL_DIR with a ballast file up to ENOSPC (after
the store made its directories); every later call finds it full. The model's
``counts`` buffer adds 1 per record it trains, so the final checkpoint says how often
each record was trained. ``--crash-at S`` ends the process hard (``os._exit(9)``,
no close) after step S on a fresh run. A restored run prints ``FIRST_STEP <unix s>``
after its first step. Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

from checkpoint_store import TieredCheckpointStore
from tests._client_train import make_state
from trainer_client import TrainingSession

BALLAST = "ballast"


def fill_up(root: str) -> None:
    """Write a ballast file into ``root`` until the file system says ENOSPC."""
    path = os.path.join(root, BALLAST)
    if os.path.exists(path):
        return
    block = b"\0" * 4096
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("redis")
    ap.add_argument("local")
    ap.add_argument("remote")
    ap.add_argument("records", type=int)
    ap.add_argument("--crash-at", type=int, default=0)
    args = ap.parse_args()
    store = TieredCheckpointStore(args.local, args.remote, keep_last=2, chunk_bytes=64 << 10)
    fill_up(args.local)
    state, model, _ = make_state(args.records)
    session = TrainingSession(args.redis, dataset="heal", run="job", store=store, block_ms=100)
    step = session.restore(state)
    fresh, restored = step == 0, step
    for batch in session.batches(DataLoader(session.dataset(batch_size=4), batch_size=None)):
        if batch is None:
            break
        model.counts.index_add_(0, batch.data[:, 0].long(), torch.ones(len(batch)))
        step += 1
        if not fresh and step == restored + 1:
            print(f"FIRST_STEP {time.time()}", flush=True)
        if step % 3 == 0:
            session.checkpoint(state, step, blocking=True)
        if fresh and step == args.crash_at:
            sys.stdout.flush()
            os._exit(9)
    session.checkpoint(state, step, blocking=True)
    session.close()
    local = [m.step for m in store.local.list()]
    store.close(wait_upload=True)
    print(json.dumps({"step": step, "remote_only_saves": store.remote_only_saves,
                      "local_steps": local}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
