"""The ledger job in torchtitan (run by tests as a forked process, SIGKILLed).

torchtitan's own ``CheckpointManager`` (made by ``checkpoint_manager``), its own
``OptimizersContainer`` and ``LRSchedulersContainer``, and ``TrainguardDataLoader`` as
its data loader. The model holds ``counts``, one float per record (a buffer, so in the
model's state); each step adds 1 to the count of every record of every rank's batch
(all-reduced, like gradients). ``manager.save(step)`` every ``--ckpt-every`` steps,
``manager.load()`` at start; after the data ends a last save (``last_step=True``).

Prints ``<rank>: READY``, ``<rank>: START <step>``, ``<rank>: STEP <step>`` after
each step, ``<rank>: DONE <step>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def say(line: str) -> None:
    sys.stdout.write(f"{os.environ.get('RANK', '0')}: {line}\n")
    sys.stdout.flush()


class Ledger(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.register_buffer("counts", torch.zeros(n))


class TrainState:
    """torchtitan's train state, reduced to the step (Stateful)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def warm_up() -> None:
    """In the fork server: pay the lazy imports (torchtitan, Adam's dynamo)."""
    import torchtitan.components.checkpoint  # noqa: F401

    import checkpoint_store

    assert checkpoint_store.CheckpointStore
    model = Ledger(4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.lin(torch.zeros(2, 8)).sum().backward()
    opt.step()


def main(argv: list[str] | None = None) -> int:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    from trainguard.integrations.torchtitan import TrainguardDataLoader, checkpoint_manager

    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world)
    loader = TrainguardDataLoader(args.redis, dataset=args.dataset, run=args.run,
                                  store=args.store, batch_size=args.batch_size,
                                  num_workers=args.workers, keep_last=2, block_ms=200)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP broadcasts them)
    model = Ledger(args.n)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-3})]),
        model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=10_000)
    train_state = TrainState()
    manager = checkpoint_manager(
        loader, CheckpointManager.Config(enable=True, interval=args.ckpt_every, keep_latest_k=0),
        model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": train_state}, sd_adapter=None)
    say("READY")
    manager.load()
    say(f"START {train_state.step}")
    for batch in loader:
        local = torch.zeros(args.n)
        if len(batch):
            local.index_add_(0, batch[:, 0].long(), torch.ones(len(batch)))
        if world > 1:
            dist.all_reduce(local)
        model.counts += local
        optimizers.zero_grad()
        x = batch.reshape(-1, 8).float() / args.n
        model.lin(x).pow(2).sum().backward()
        if world > 1:
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
        optimizers.step()
        schedulers.step()
        train_state.step += 1
        say(f"STEP {train_state.step}")
        time.sleep(args.sleep_ms / 1000)
        manager.save(train_state.step)
    if train_state.step % args.ckpt_every:  # else the loop's save was the last one
        manager.save(train_state.step, last_step=True)
    manager.close()
    loader.close()
    say(f"DONE {train_state.step}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
