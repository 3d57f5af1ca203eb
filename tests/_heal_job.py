"""The ledger job of tests/test_heal.py, run under torchrun (one or two ranks, gloo).

Like tests/_client_train.py: the model's ``counts`` buffer adds 1 per record each
step (summed over ranks), so the final checkpoint says how often each record was
trained. Prints ``<rank>: PID <pid>``, ``READY <step>`` after the restore, ``STEP
<step>`` after each step, ``DONE <step>`` at the end. Faults, for the tests:
``--crash-at S`` raises at step S in every attempt (a bug at step N);
``--poison R`` raises in the step whose batch holds record R (a poisoned record);
``--die-before-checkpoint`` SIGKILLs itself a second after its first step on a
fresh run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests._client_train import make_state
from trainer_client import TrainingSession, init_process_group
from trainer_client.watchdog import WatchdogConfig


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--records", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--crash-at", type=int, default=0)
    ap.add_argument("--poison", type=int, default=-1)
    ap.add_argument("--die-before-checkpoint", action="store_true")
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        sys.stdout.write(f"{rank}: {line}\n")
        sys.stdout.flush()

    say(f"PID {os.getpid()}")
    # Budgets sized for a test: steps of ~20 ms, so a stall of 1.5 s is a hang.
    cfg = WatchdogConfig(k=10, floor_s=1.5, ceiling_s=120, startup_s=60, restore_s=60,
                         checkpoint_s=60, min_steps=3, heartbeat_s=0.2)
    if world > 1:
        init_process_group("gloo", config=cfg)
    state, model, _ = make_state(args.records)
    session = TrainingSession(args.redis, dataset="heal", run="job", store=args.store,
                              rank=rank, world_size=world, keep_last=4, block_ms=100,
                              watchdog=cfg)
    step = session.restore(state)
    say(f"READY {step}")
    fresh = step == 0
    it = iter(session.batches(DataLoader(session.dataset(batch_size=args.batch_size),
                                         batch_size=None)))
    while True:
        batch = next(it, None)
        local = torch.zeros(args.records)
        if batch is not None:
            local.index_add_(0, batch.data[:, 0].long(), torch.ones(len(batch)))
        if world > 1:
            more = torch.tensor([0.0 if batch is None else 1.0])
            dist.all_reduce(more)
            if more.item() == 0:
                break
            dist.all_reduce(local)
        elif batch is None:
            break
        time.sleep(args.sleep_ms / 1000)
        if step + 1 == args.crash_at:
            raise RuntimeError(f"deterministic bug at step {step + 1}")
        if batch is not None and args.poison in batch.data[:, 0].tolist():
            raise ValueError(f"poisoned record {args.poison} in the batch of step {step + 1}")
        model.counts += local
        step += 1
        say(f"STEP {step}")
        if fresh and args.die_before_checkpoint and rank == 0:
            time.sleep(1.0)  # a heartbeat (every 0.2 s) says where it was
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.ckpt_every == 0:
            session.checkpoint(state, step, blocking=True)  # a crash never outruns it
    session.checkpoint(state, step, blocking=True)
    session.close()
    say(f"DONE {step}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
