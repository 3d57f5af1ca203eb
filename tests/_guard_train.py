"""Test helper: a guarded ledger training loop (in-process, or as a subprocess).

The model's ``counts`` parameter has one entry per record. A step's backward gives
``-1`` to the gradient of each record in the batch and the ``counts`` parameter group
uses plain SGD with lr 1, so *applying* a step adds exactly 1 to the count of each of
its records and a step the guard refuses adds nothing. Counts are in the checkpoints,
so a rollback takes them back with the weights.

The loss the guard sees is ``1.0`` (plus a tiny real-model term) unless the test's
``inject`` says otherwise for a batch: keeping the normal loss flat means only the
injected values can look like spikes.

Subprocess use (health test): ``python -m tests._guard_train --redis URL --store URL
--n N --critical-at STEP``: the fake NVML turns CRITICAL after that step; prints
``STEP <step> <offsets json>`` after each applied step.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainer_client.dataset import Batch
from trainer_client.guard import GuardedTraining, batch_id
from trainer_client.health import HealthMonitor
from trainer_client.session import TrainingSession
from trainer_client.spikes import RollbackConfig, SpikeConfig

DATASET, RUN = "tok", "exp"


class Ledger(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.counts = nn.Parameter(torch.zeros(n))


def make_state(n: int) -> tuple[dict[str, Any], Ledger, torch.optim.Optimizer]:
    model = Ledger(n)
    opt = torch.optim.SGD([
        {"params": model.lin.parameters(), "lr": 1e-4},
        {"params": [model.counts], "lr": 1.0},
    ])
    return {"model": model, "optim": opt}, model, opt


def records(batch: Batch) -> list[int]:
    """The dataset indices of the batch's records (tests/_client_fill.py payloads)."""
    return [int(i) for i in batch.data[:, 0].tolist()]


def session(url: str, store: str, *, deterministic: bool = True, rank: int = 0,
            world_size: int = 1) -> TrainingSession:
    # keep_last=100: the tests read every manifest the run wrote.
    return TrainingSession(url, dataset=DATASET, run=RUN, store=store, rank=rank,
                           world_size=world_size, deterministic=deterministic, block_ms=200,
                           keep_last=100)


def train_step(model: Ledger, n: int) -> Callable[[Batch], torch.Tensor]:
    def step(batch: Batch) -> torch.Tensor:
        idx = batch.data[:, 0].long()
        x = batch.data.float() / n
        real = model.lin(x).pow(2).mean()
        (real - model.counts[idx].sum()).backward()
        return 1.0 + 1e-3 * real.detach()

    return step


@dataclass
class Result:
    guarded: GuardedTraining
    model: Ledger
    step: int
    rollbacks: list[tuple[int, str]] = field(default_factory=list)
    """(step of the spike, batch ID) per rollback."""
    restored: list[int] = field(default_factory=list)
    """The step each rollback went back to."""
    applied: list[str] = field(default_factory=list)
    """Batch IDs of the applied steps, in order (replays included)."""
    batches: dict[str, list[int]] = field(default_factory=dict)
    """Batch ID -> dataset indices of its records, for every batch the loop saw."""


def train(
    url: str,
    store: str,
    n: int,
    *,
    inject: Callable[[Batch, int], float | None] = lambda b, s: None,
    spike: SpikeConfig | None = None,
    rollback: RollbackConfig | None = None,
    checkpoint_every: int = 5,
    stop_after_rollback: bool = False,
    deterministic: bool = True,
    scale_lr: bool = True,
) -> Result:
    """Run the guarded loop to the end of the data (or, with ``stop_after_rollback``,
    until just after the first rollback: blocking checkpoint, close, return).
    ``inject(batch, step)`` returns the loss to report instead of the normal one."""
    state, model, opt = make_state(n)
    sess = session(url, store, deterministic=deterministic)
    guarded = GuardedTraining(sess, state, optimizer=opt, spike=spike, rollback=rollback,
                              scale_lr=scale_lr)
    res = Result(guarded, model, guarded.restore())
    step_fn = train_step(model, n)
    try:
        for batch in guarded.batches(sess.dataset(batch_size=8)):
            bid = batch_id(batch)
            res.batches[bid] = records(batch)
            loss: float | torch.Tensor = step_fn(batch)
            injected = inject(batch, guarded.step + 1)
            if injected is not None:
                loss = injected
            spike_step = guarded.step + 1
            applied = guarded.observe(loss, batch)
            if applied:
                opt.step()
                res.applied.append(bid)
            else:
                res.rollbacks.append((spike_step, bid))
                res.restored.append(guarded.step)
                if stop_after_rollback:
                    guarded.checkpoint(blocking=True)
                    break
            opt.zero_grad(set_to_none=True)
            if applied and guarded.step % checkpoint_every == 0:
                guarded.checkpoint()
        else:
            guarded.checkpoint(blocking=True)
        res.step = guarded.step
    finally:
        sess.close()
    return res


def main(argv: list[str] | None = None) -> int:
    from tests._fake_nvml import FakeGpu, FakeNvml
    from trainer_client.health import HealthProbe

    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--critical-at", type=int, required=True)
    args = ap.parse_args(argv)

    gpu = FakeGpu()
    monitor = HealthMonitor(HealthProbe(nvml=FakeNvml([gpu])), interval_s=3600.0)
    monitor.probe_now()
    state, model, opt = make_state(args.n)
    sess = session(args.redis, args.store)
    guarded = GuardedTraining(sess, state, optimizer=opt, monitor=monitor)
    inner = train_step(model, args.n)

    def step_fn(batch: Batch) -> torch.Tensor:
        loss = inner(batch)
        # The step being computed is guarded.step + 1; once it is applied and
        # reported, the GPU "fails" and the probe sees it before the next batch.
        print(f"BATCH {guarded.step + 1} {json.dumps(records(batch))}", flush=True)
        return loss

    def report_after_step() -> None:
        print(f"STEP {guarded.step} {json.dumps(sess.offsets, sort_keys=True)}", flush=True)
        if guarded.step == args.critical_at:
            gpu.ecc_uncorrected = 1
            monitor.probe_now()

    # run() with a hook: the optimizer's step is the moment a step is applied.
    opt.register_step_post_hook(lambda *_: report_after_step())
    guarded.restore()
    guarded.run(sess.dataset(batch_size=8), step_fn, checkpoint_every=1000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
