"""A tiny GPT in a Hugging Face ``Trainer`` on a trainguard stream of packed tokens.

Same data as ``examples/lightning_gpt.py``; ``--die-at-step`` SIGKILLs the run, and the
same command again resumes it through the Trainer's own ``resume_from_checkpoint``::

    python examples/hf_gpt.py --dataset story --run-name gpt-hf --die-at-step 25
    python examples/hf_gpt.py --dataset story --run-name gpt-hf
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, expected, parse_args, report

from trainguard.integrations.hf import TrainguardHF


class GPT(nn.Module):
    """The Trainer's model: ``forward(input_ids, labels)`` returning the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyGPT()

    def forward(self, input_ids: torch.Tensor, labels: Any = None) -> dict[str, torch.Tensor]:
        if not len(input_ids):  # a rank out of data, in step with the others (DDP)
            self.model.count(input_ids)  # the ledger's all-reduce: every rank, every step
            return {"loss": sum(p.sum() for p in self.parameters()) * 0.0}
        return {"loss": self.model.loss(input_ids)}


class DieAt(TrainerCallback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            print(f"SIGKILL at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> int:
    args = parse_args(__doc__, "gpt-hf")
    url, root = args.url, args.root
    tg = TrainguardHF(url, dataset=args.dataset, run=args.run, store=f"file://{root}/trainguard",
                      batch_size=args.batch_size, labels=False)
    sequences, _ = expected(url, args.dataset)
    targs = TrainingArguments(
        str(root / "hf"), per_device_train_batch_size=args.batch_size,
        max_steps=-(-sequences // args.batch_size), save_steps=args.ckpt_every, save_total_limit=2,
        ignore_data_skip=True, report_to=[], use_cpu=True, learning_rate=3e-3,
        logging_steps=10, disable_tqdm=True,
    )
    model = GPT()
    trainer = tg.attach(Trainer(model=model, args=targs, train_dataset=tg.train_dataset,
                                callbacks=[tg.callback, DieAt(args.die_at_step)]))
    trainer.train(resume_from_checkpoint=tg.last_checkpoint(targs.output_dir))
    print(f"resumed from step {tg.restored_step}, ended at step {trainer.state.global_step}",
          flush=True)
    ok = report(model.model, url, args.dataset)
    tg.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
