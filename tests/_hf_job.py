"""The ledger job in a Hugging Face ``Trainer`` (run by tests as a forked process).

The model holds ``counts``, one float per record; each forward pass over a batch adds
1 to the count of each of its records (``input_ids[:, 0]`` is the record's index).
Checkpoints are the Trainer's own (``save_steps``) with the trainguard callback, and
every attempt resumes with ``trainer.train(resume_from_checkpoint=tg.last_checkpoint(...))``.
Launched with ``WORLD_SIZE > 1`` (one process per rank), the Trainer runs DDP on gloo
and each step adds every rank's records to the counts on every rank.

Prints ``<rank>: READY``, ``<rank>: STEP <step>``, ``<rank>: SAVE <step>`` before a
checkpoint, ``<rank>: COMMITTED <step>`` after its commit, ``<rank>: DONE``.
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
from transformers import Trainer, TrainerCallback, TrainingArguments

from trainguard.integrations.hf import TrainguardHF


def say(line: str) -> None:
    sys.stdout.write(f"{os.environ.get('RANK', '0')}: {line}\n")
    sys.stdout.flush()


class Ledger(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(8, 1)
        self.register_buffer("counts", torch.zeros(n))

    def forward(self, input_ids: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            local = torch.zeros(self.n)
            local.index_add_(0, input_ids[:, 0].long(), torch.ones(len(input_ids)))
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(local)  # every rank's records, on every rank
            self.counts += local
        # A sum, not a mean: an empty batch (a rank out of data) gives a zero loss that
        # still reaches every parameter, as DDP's gradient all-reduce needs.
        loss = self.lin(input_ids.float() / self.n).pow(2).sum() / max(1, len(input_ids))
        return {"loss": loss}


class Say(TrainerCallback):
    def __init__(self, sleep_ms: float) -> None:
        self.sleep_s = sleep_ms / 1000

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        say(f"STEP {state.global_step}")
        time.sleep(self.sleep_s)
        if control.should_save:
            say(f"SAVE {state.global_step}")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        say(f"COMMITTED {state.global_step}")


def warm_up() -> None:
    import checkpoint_store

    assert checkpoint_store.CheckpointStore
    model = Ledger(4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 8, dtype=torch.long))["loss"].backward()
    opt.step()


def job_args(argv: list[str] | None, *required: str) -> argparse.Namespace:
    """The ledger jobs' flags (``required``: the string flags they need), one torch
    thread, and the local rank a framework expects of a process launched per rank."""
    ap = argparse.ArgumentParser()
    for flag in required:
        ap.add_argument(flag, required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--ckpt-every", type=int, default=6)
    ap.add_argument("--sleep-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one process per rank, from the test
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = job_args(argv, "--redis", "--dataset", "--run", "--store", "--out")
    tg = TrainguardHF(args.redis, dataset=args.dataset, run=args.run, store=args.store,
                      batch_size=args.batch_size, keep_last=2, block_ms=200)
    targs = TrainingArguments(
        args.out, per_device_train_batch_size=args.batch_size,
        max_steps=-(-args.n // args.batch_size), save_steps=args.ckpt_every, save_total_limit=3,
        ignore_data_skip=True, report_to=[], use_cpu=True, logging_strategy="no",
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        ddp_find_unused_parameters=False,
        disable_tqdm=True, learning_rate=1e-3,
    )
    # Say first: its on_save reports the commit the trainguard callback made before it.
    trainer = tg.attach(Trainer(model=Ledger(args.n), args=targs, train_dataset=tg.train_dataset,
                                callbacks=[tg.callback, Say(args.sleep_ms)]))
    say("READY")
    trainer.train(resume_from_checkpoint=tg.last_checkpoint(args.out))
    tg.close()
    say(f"DONE {trainer.state.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
