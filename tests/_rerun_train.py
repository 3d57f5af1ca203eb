"""A user's loop written the naive way (run by tests as a subprocess): restore, train
every batch, checkpoint every ``--ckpt-every`` steps and once more at the end, with no
guard of its own. Logs the session's INFO lines to stderr; prints ``BATCHES <n>`` (the
batches the loop got) and ``STEP <step>`` (the final step) at the end."""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from torch.utils.data import DataLoader

from trainer_client import TrainingSession


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--ckpt-every", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    model = torch.nn.Linear(8, 1)
    state = {"model": model}
    session = TrainingSession(args.redis, dataset="tok", run="exp", store=args.store,
                              block_ms=200)
    step = session.restore(state)
    batches = 0
    for batch in session.batches(DataLoader(session.dataset(batch_size=8), batch_size=None)):
        loss = model(batch.data.float()).pow(2).mean()
        loss.backward()
        batches += 1
        step += 1
        if step % args.ckpt_every == 0:
            session.checkpoint(state, step)
    session.checkpoint(state, step, blocking=True)
    session.close()
    print(f"BATCHES {batches}")
    print(f"STEP {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
