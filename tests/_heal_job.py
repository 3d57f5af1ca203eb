"""The ledger job of tests/test_heal.py, run under torchrun (one or two ranks, gloo).

Like tests/_client_train.py: the model's ``counts`` buffer adds 1 per record each
step (summed over ranks), so the final checkpoint says how often each record was
trained. Prints ``<rank>: PID <pid>``, ``READY <step>`` after the restore, ``STEP
<step>`` after each step, ``DONE <step>`` at the end. Faults, for the tests:
``--crash-at S`` raises at step S in every attempt (a bug at step N);
``--poison R`` raises in the step whose batch holds record R (a poisoned record);
``--die-before-checkpoint`` SIGKILLs itself a second after its first step on a
fresh run; ``--exit-at S`` calls ``sys.exit(3)`` after step S on a fresh run, without
``session.close()``; ``--spike-file F`` (bench/chaos.py): when F holds ``<step> x50`` or
``<step> nan``, that step's loss (1.0 on every other step) is multiplied by 50 or made
NaN, once per process, and the spike guard's verdict rolls every rank back together
(they all read F at the same step), printing ``ROLLBACK <step>``;
``--critical-file F`` (bench/chaos.py): when F holds ``<node> <step>``, the worker of
node ``<node>`` (``$TRAINGUARD_NODE_ID``) sees its (fake NVML) GPU report an
uncorrected ECC error once it trained step ``<step>``: every rank learns it at the
next step boundary, all checkpoint together, the bad rank quarantines its node and
stops its agent (exit 75), the others exit 76 and re-form without it, printing
``CRITICAL <step>`` before that.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests._client_train import make_state
from trainer_client import TrainingSession, init_process_group
from trainer_client.errors import GpuCriticalError, PeerGpuCriticalError
from trainer_client.health import HealthMonitor, HealthProbe
from trainer_client.health.leave import leave_node
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


def _critical_at(critical_file: str) -> int:
    """The step after which this node's GPU fails (0: never), from ``critical_file``."""
    try:
        with open(critical_file) as f:
            node, at = f.read().split()
    except (OSError, ValueError):
        return 0
    return int(at) if node == os.environ.get("TRAINGUARD_NODE_ID") else 0


def _fake_gpu() -> tuple[HealthMonitor, Any]:
    """A health monitor over one fake NVML GPU (the one allowed fake: no GPU here)."""
    from tests._fake_nvml import FakeGpu, FakeNvml

    gpu = FakeGpu()
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])), interval_s=3600.0)
    monitor.probe_now()
    return monitor, gpu


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
    ap.add_argument("--exit-at", type=int, default=0)
    ap.add_argument("--spike-file", default="")
    ap.add_argument("--critical-file", default="")
    ap.add_argument("--watchdog-floor-s", type=float, default=1.5)
    ap.add_argument("--watchdog-peer-silence-s", type=float, default=10.0)
    args = ap.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        sys.stdout.write(f"{rank}: {line}\n")
        sys.stdout.flush()

    say(f"PID {os.getpid()}")
    # Budgets sized for a test: steps of ~20 ms, so a stall of 1.5 s is a hang.
    cfg = WatchdogConfig(k=10, floor_s=args.watchdog_floor_s, ceiling_s=120, startup_s=60, restore_s=60,
                         checkpoint_s=60, min_steps=3, heartbeat_s=0.2,
                         peer_silence_s=args.watchdog_peer_silence_s)
    if world > 1:
        init_process_group("gloo", config=cfg)
    state, model, _ = make_state(args.records)
    monitor, gpu = _fake_gpu() if args.critical_file else (None, None)
    session = TrainingSession(args.redis, dataset="heal", run="job", store=args.store,
                              rank=rank, world_size=world, keep_last=4, block_ms=100,
                              watchdog=cfg, health_monitor=monitor)
    step = session.restore(state)
    say(f"READY {step}")
    fresh = step == 0
    spikes, fired = LossSpikeDetector(SpikeConfig(warmup_steps=5)), set()
    it = iter(session.batches(DataLoader(session.dataset(batch_size=args.batch_size),
                                         batch_size=None)))
    while True:
        try:
            batch = next(it, None)
        except GpuCriticalError as exc:  # every rank, at the same step boundary
            return _leave_critical(session, state, step, exc, say)
        local = torch.zeros(args.records)
        # A rank out of data while a peer is not steps on join mode's empty batches
        # (no data, len 0) until every rank is out.
        if batch is not None and len(batch):
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
        if batch is not None and len(batch) and args.poison in batch.data[:, 0].tolist():
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
        if fresh and step == args.exit_at:
            sys.exit(3)  # the script gives up: no session.close(), no exception
        if step % args.ckpt_every == 0:
            session.checkpoint(state, step, blocking=True)  # a crash never outruns it
        if gpu is not None and not gpu.ecc_uncorrected and 0 < _critical_at(
                args.critical_file) <= step:
            gpu.ecc_uncorrected = 1  # the GPU fails; the next step boundary learns it
            monitor.probe_now()  # type: ignore[union-attr]
    session.checkpoint(state, step, blocking=True)
    session.close()
    say(f"DONE {step}")
    if world > 1:
        dist.destroy_process_group()
    return 0


def _leave_critical(session: TrainingSession, state: Any, step: int, exc: GpuCriticalError,
                    say: Any) -> int:
    """What ``GuardedTraining.exit_on_gpu_critical`` does, for this loop: checkpoint
    with every rank, then the bad rank quarantines its node and stops its agent."""
    say(f"CRITICAL {step}")
    session.checkpoint(state, step, blocking=True)
    session.close()
    if not isinstance(exc, PeerGpuCriticalError):
        leave_node(session.redis_url, f"GPU health CRITICAL after step {step}")
    sys.stdout.flush()
    os._exit(exc.exit_code)  # the agent reads the code; torch's teardown would hang on peers


if __name__ == "__main__":
    sys.exit(main())
