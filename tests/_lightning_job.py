"""The ledger job in PyTorch Lightning (run by tests as a forked process, SIGKILLed).

A LightningModule holds ``counts``, one float per record; each training step adds 1 to
the count of every record of its batch. Checkpoints are Lightning's own
(``ModelCheckpoint(every_n_train_steps=..., save_last=True)``) through the trainguard
plugin, and every attempt resumes with ``trainer.fit(..., ckpt_path="last")``. After
``fit`` the job saves ``last.ckpt`` once more, so the final checkpoint has every step.

Prints ``0: READY``, ``0: START <step>`` when training starts (the resumed step; after
``fit`` when there was nothing left to train),
``0: STEP <step>`` after each step, ``0: SAVE <step>`` when a checkpoint starts,
``0: COMMITTED <step>`` once its marker is written, ``0: DONE``; with
``--die-before-marker K:last`` (or ``K:any``) ``0: DYING <step>`` before it SIGKILLs
itself between its K-th commit and that commit's ``last`` (or first) marker.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from trainguard.integrations.lightning import TrainguardCheckpointIO, TrainguardDataModule


def say(line: str) -> None:
    sys.stdout.write(f"{os.environ.get('RANK', '0')}: {line}\n")
    sys.stdout.flush()


class Ledger(L.LightningModule):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(8, 1)
        self.register_buffer("counts", torch.zeros(n))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        local = torch.zeros(self.n)
        if len(batch):
            local.index_add_(0, batch[:, 0].long(), torch.ones(len(batch)))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)  # every rank's records, on every rank (like gradients)
        self.counts += local
        # A sum, not a mean: an empty batch (a rank out of data) gives a zero loss that
        # still reaches every parameter, as DDP's gradient all-reduce needs.
        x = batch.reshape(-1, 8).float() / self.n
        return self.lin(x).pow(2).sum() / max(1, len(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Say(Callback):
    def __init__(self, sleep_ms: float) -> None:
        self.sleep_s = sleep_ms / 1000
        self.started = False

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        say(f"STEP {trainer.global_step}")
        time.sleep(self.sleep_s)

    def on_save_checkpoint(self, trainer: L.Trainer, *args: Any) -> None:
        say(f"SAVE {trainer.global_step}")

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.started = True
        say(f"START {trainer.global_step}")


class LoudIO(TrainguardCheckpointIO):
    """Says COMMITTED after each marker; with ``die_before`` (k, "last" or "any"), the
    job SIGKILLs itself after its k-th commit, before that commit's ``last`` marker
    (or before its first marker): a kill between a commit and its marker."""

    def __init__(self, dm: TrainguardDataModule, die_before: tuple[int, str] | None) -> None:
        super().__init__(dm)
        self.die_before = die_before
        self.commits: list[str] = []
        self.resumed_commits: set[str] = set()

    def resumed(self, start: Any) -> None:
        # The commit a fit resumed is marked again at its start: not a commit of this job.
        if start is not None and start.commit is not None:
            self.resumed_commits.add(start.commit)
        super().resumed(start)

    def write_marker(self, path: Any, marker: dict[str, Any]) -> None:
        if marker["commit"] not in self.commits and marker["commit"] not in self.resumed_commits:
            self.commits.append(marker["commit"])
        if self.die_before is not None:
            k, which = self.die_before
            if len(self.commits) == k and (which == "any" or marker["last"]):
                say(f"DYING {marker['step']}")
                os.kill(os.getpid(), signal.SIGKILL)
        super().write_marker(path, marker)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        say(f"COMMITTED {checkpoint['global_step']}")


def trainer_for(dm: TrainguardDataModule, ckpt_dir: Path, every: int, extra: list[Any],
                max_steps: int = -1, world: int = 1) -> L.Trainer:
    from lightning.pytorch.strategies import DDPStrategy

    strategy: Any = DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"
    return L.Trainer(
        max_epochs=1, max_steps=max_steps, accelerator="cpu", devices=world, strategy=strategy,
        logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[dm.checkpoint_io],
        # extra first: Say's START comes before the datamodule's callback marks the commit.
        callbacks=[*extra, dm.callback, ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=every,
                                                        save_last=True)],
    )


def warm_up() -> None:
    """In the fork server: pay the lazy imports (Lightning's trainer, Adam's dynamo)."""
    import checkpoint_store

    assert checkpoint_store.CheckpointStore
    model = Ledger(4)
    opt = model.configure_optimizers()
    model.lin(torch.zeros(2, 8)).sum().backward()
    opt.step()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ckpt-every", type=int, default=8)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0, help="the DataLoader's reading workers")
    ap.add_argument("--die-before-marker", default=None,
                    help="K:last or K:any: SIGKILL after the K-th commit, before its marker")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("PL_DISABLE_FORK", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # launched by the test, one process per rank: Lightning launches none
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        os.environ.setdefault("NODE_RANK", "0")
    dm = TrainguardDataModule(args.redis, dataset=args.dataset, run=args.run, store=args.store,
                              batch_size=args.batch_size, num_workers=args.workers,
                              keep_last=2, block_ms=200)
    die = None
    if args.die_before_marker:
        k, _, which = args.die_before_marker.partition(":")
        die = (int(k), which or "last")
    dm.checkpoint_io = LoudIO(dm, die)
    ckpt_dir = Path(args.ckpt_dir)
    loud = Say(args.sleep_ms)
    trainer = trainer_for(dm, ckpt_dir, args.ckpt_every, [loud], world=world)
    say("READY")
    trainer.fit(Ledger(args.n), datamodule=dm, ckpt_path="last")
    if not loud.started:  # resumed a finished fit: Lightning trains nothing, starts nothing
        say(f"START {trainer.global_step}")
    trainer.save_checkpoint(ckpt_dir / "last.ckpt")
    dm.close()
    say(f"DONE {trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
