"""The ledger job of tests/test_heal.py, run under torchrun (one or two ranks, gloo).

Like tests/_client_train.py: the model's ``counts`` buffer adds 1 per record each
step (summed over ranks), so the final checkpoint says how often each record was
trained. Prints ``<rank>: PID <pid>``, ``READY <step>`` after the restore, ``STEP
<step>`` after each step, ``DONE <step>`` at the end. Faults, for the tests:
``--crash-at S`` raises at step S in every attempt (a bug at step N);
``--poison R`` raises in the step whose batch holds record R (a poisoned record);
``--die-before-checkpoint`` SIGKILLs itself a second after its first step on a
fresh run; ``--spike-file F`` (bench/chaos.py): when F holds ``<step> x50`` or
``<step> nan``, that step's loss (1.0 on every other step) is multiplied by 50 or made
NaN, once per process, and the spike guard's verdict rolls every rank back together
(they all read F at the same step), printing ``ROLLBACK <step>``.
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
from trainer_client.spikes import LossSpikeDetector, SpikeConfig
from trainer_client.watchdog import WatchdogConfig


def _loss(spike_file: str, step: int, fired: set[int]) -> float:
    """The step's loss: 1.0, unless ``spike_file`` asks this step for a spike."""
    try:
        with open(spike_file) as f:
            at, kind = f.read().split()
    except (OSError, ValueError):
        return 1.0
    if int(at) != step or step in fired:
        return 1.0
    fired.add(step)
    return float("nan") if kind == "nan" else 50.0


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
    ap.add_argument("--spike-file", default="")
    ap.add_argument("--watchdog-floor-s", type=float, default=1.5)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        sys.stdout.write(f"{rank}: {line}\n")
        sys.stdout.flush()

    say(f"PID {os.getpid()}")
    # Budgets sized for a test: steps of ~20 ms, so a stall of 1.5 s is a hang.
    cfg = WatchdogConfig(k=10, floor_s=args.watchdog_floor_s, ceiling_s=120, startup_s=60, restore_s=60,
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
    spikes, fired = LossSpikeDetector(SpikeConfig(warmup_steps=5)), set()
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
        verdict = spikes.observe(step + 1, _loss(args.spike_file, step + 1, fired))
        if verdict.spike:  # this step's batch is dropped: the rollback replays it
            step = session.rollback(state, reason=verdict.reason)
            say(f"ROLLBACK {step}")
            continue
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
