"""A tiny GPT in PyTorch Lightning on a trainguard stream of packed token sequences.

Ingest the bundled text tokenized and packed (65 tokens: 64 inputs, 64 targets), then
train; ``--die-at-step`` SIGKILLs the run there, and the same command again resumes it
with Lightning's own ``fit(ckpt_path="last")``::

    trainguard ingest --dataset story --source examples/data/corpus.txt --format text \\
        --tokenizer examples/data/tokenizer.json --pack 65 --partitions 4
    python examples/lightning_gpt.py --dataset story --run-name gpt-pl --die-at-step 25
    python examples/lightning_gpt.py --dataset story --run-name gpt-pl

The second run ends with ``sequences trained: N of N; each exactly once``. Redis comes
from ``$TRAINGUARD_REDIS_URL`` (or ``--redis-url``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_gpt import TinyGPT, parse_args, report

from trainguard.integrations.lightning import TrainguardDataModule


class GPT(L.LightningModule):
    def __init__(self, die_at_step: int | None) -> None:
        super().__init__()
        self.model = TinyGPT()
        self.die_at_step = die_at_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model.loss(batch.long())
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        if self.global_step == self.die_at_step:
            print(f"SIGKILL at step {self.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> int:
    args = parse_args(__doc__, "gpt-pl")
    url, root = args.url, args.root
    module = GPT(args.die_at_step)
    dm = TrainguardDataModule(url, dataset=args.dataset, run=args.run,
                              store=f"file://{root}/trainguard", batch_size=args.batch_size)
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_model_summary=False,
        enable_progress_bar=False, plugins=[dm.checkpoint_io],
        callbacks=[dm.callback, ModelCheckpoint(dirpath=root / "lightning",
                                                every_n_train_steps=args.ckpt_every, save_last=True)],
    )
    trainer.fit(module, datamodule=dm, ckpt_path="last")
    trainer.save_checkpoint(root / "lightning" / "last.ckpt")
    print(f"resumed from step {dm.restored_step}, ended at step {trainer.global_step}", flush=True)
    ok = report(module.model, url, args.dataset)
    dm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
