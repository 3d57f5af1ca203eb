"""A small real training job on a trainguard stream: a next-token MLP on CPU.

Records are JSON objects ``{"id": <int>, "tokens": [<int>, ...]}`` (``trainguard
demo`` generates them; any dataset of that shape works). The model predicts each
token from the previous ``--context`` tokens. Besides the model and optimizer, the
checkpointed state holds a *ledger*: how many times each record ID went through an
optimizer step. Because the ledger is restored together with the weights and the
stream offsets, after any crash and restart every count must end at exactly 1:
that is trainguard's promise, and ``trainguard demo`` checks it.

It lives in the package (not only in ``examples/``) so that a wheel carries what
``trainguard demo`` runs; ``examples/train_mlp.py`` runs it from a checkout. Run it
against a running service (``docker compose --profile trainer up``, or by hand)::

    python -m trainguard.ops.demo_trainer --redis-url redis://127.0.0.1:6379/0 \\
        --dataset demo --run-name mlp --store file:///tmp/ckpt/mlp --records 4000

It prints one JSON event per line on stdout (restored, checkpoint, done), which is
what the demo reads. Kill it with SIGKILL at any moment and start it again: it
resumes from the newest checkpoint with nothing lost and nothing repeated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from trainer_client import TrainingSession

VOCAB = 64


class NextTokenMLP(nn.Module):
    def __init__(self, context: int, dim: int = 32, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mlp = nn.Sequential(
            nn.Flatten(), nn.Linear(context * dim, hidden), nn.GELU(), nn.Linear(hidden, VOCAB)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(x))


def collate(records: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Records -> record IDs and a [n, length] token tensor (runs in the workers)."""
    return {
        "id": torch.tensor([int(r["id"]) for r in records], dtype=torch.long),
        "tokens": torch.tensor([r["tokens"] for r in records], dtype=torch.long),
    }


def windows(tokens: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (previous ``context`` tokens -> next token) pair of every row."""
    x = tokens.unfold(1, context + 1, 1)  # [n, L - context, context + 1]
    x = x.reshape(-1, context + 1)
    return x[:, :context], x[:, context]


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default=env("TRAINGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--dataset", default=env("TRAINGUARD_DATASET", "demo"))
    p.add_argument("--run-name", "--run", dest="run", default=env("TRAINGUARD_RUN", "mlp"),
                   help="the run's name (old spelling --run: torchrun takes it for its --run-path)")
    p.add_argument("--store", default=env("TRAINGUARD_STORE", "file:///tmp/trainguard-ckpt/mlp"),
                   help="checkpoint store URL (any fsspec URL: file://, s3://, ...)")
    p.add_argument("--records", type=int, default=int(env("TRAINGUARD_RECORDS", "4000")),
                   help="size of the ledger: record IDs are 0..records-1")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--step-delay-ms", type=float, default=0.0,
                   help="sleep per step (to watch it, or to give a kill time to land)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = NextTokenMLP(args.context)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ledger = torch.zeros(args.records, dtype=torch.int32)
    state = {"model": model, "optim": optim, "ledger": ledger}

    started = time.monotonic()
    session = TrainingSession(
        args.redis_url, dataset=args.dataset, run=args.run, store=args.store,
        keep_last=args.keep_last,
    )
    step = session.restore(state)
    emit("restored", step=step, resume_s=round(time.monotonic() - started, 3),
         trained=int(ledger.sum()))
    loader = DataLoader(
        session.dataset(args.batch_size, collate=collate), batch_size=None,
        num_workers=args.workers, persistent_workers=args.workers > 0,
    )
    loss = torch.tensor(float("nan"))
    last_checkpoint = step
    for batch in session.batches(loader):
        ids, tokens = batch.data["id"], batch.data["tokens"]
        if int(ids.max()) >= args.records or int(ids.min()) < 0:
            print(f"record id outside 0..{args.records - 1}: pass --records", file=sys.stderr)
            return 2
        x, y = windows(tokens, args.context)
        loss = nn.functional.cross_entropy(model(x), y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        ledger.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        step += 1
        emit("step", step=step, loss=round(float(loss), 4), records=len(batch))
        if step % args.checkpoint_every == 0:
            session.checkpoint(state, step)
            last_checkpoint = step
            emit("checkpoint", step=step)
        if args.step_delay_ms:
            time.sleep(args.step_delay_ms / 1000)
    if step != last_checkpoint:
        session.checkpoint(state, step, blocking=True)
        emit("checkpoint", step=step, final=True)
    session.close()  # waits for checkpoints still committing
    emit("done", step=step, loss=round(float(loss), 4), trained=int(ledger.sum()),
         duplicated=int((ledger > 1).sum()), unseen=int((ledger == 0).sum()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
