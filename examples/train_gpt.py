"""A tiny GPT on a trainguard stream: dropout, AdamW, warmup + cosine LR, 2 workers.

Records are token windows (``seq + 1`` byte-level tokens, vocabulary 256): NumPy
arrays from an ``npy`` token source (``trainguard ingest --format npy
--sample-len 65``), or JSON objects ``{"tokens": [...]}`` from a ``jsonl`` one. The
model learns to predict each next token.

Kill it with SIGKILL at any moment and start it again: it resumes from the newest
checkpoint, and the rest of the run (weights, optimizer, LR schedule, every loss) is
bitwise what an uninterrupted run computes, because the session restores the random
states (dropout) and the DataLoader's seeds with the offsets. The loop does nothing
about RNG itself::

    python examples/train_gpt.py --redis-url redis://127.0.0.1:6379/0 \\
        --dataset text --run-name gpt --store file:///tmp/ckpt/gpt

One process (the README's loop shows several ranks). Prints ``<rank>: STEP <step>
<loss> <loss as float.hex>`` per step, ``<rank>: SAVE <step>`` before each checkpoint,
``<rank>: COMMITTED <step>`` once it is committed, and ``<rank>: DONE <step>`` at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from trainer_client import TrainingSession

VOCAB = 256


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(self, seq: int, dim: int = 64, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln(self.blocks(x)))


def tokens(records: list[Any]) -> torch.Tensor:
    """jsonl records ({"tokens": [...]}) -> a [n, seq + 1] tensor (runs in the workers)."""
    return torch.tensor(np.array([r["tokens"] for r in records]), dtype=torch.long)


def warmup_cosine(warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done))

    return factor


def committed(handle: Any, step: int, say: Any) -> None:
    try:
        handle.wait()
    except Exception:
        return  # a failed save: the next checkpoint() raises its error
    say(f"COMMITTED {step}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", default=env("TRAINGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--dataset", default="text")
    p.add_argument("--run-name", "--run", dest="run", default="gpt",
                   help="the run's name (old spelling --run: torchrun takes it for its --run-path)")
    p.add_argument("--store", default="file:///tmp/trainguard-ckpt/gpt")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="model init (the run seed is the session's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    printing = threading.Lock()  # COMMITTED lines come from the writer thread

    def say(line: str) -> None:
        with printing:
            sys.stdout.write(f"0: {line}\n")
            sys.stdout.flush()

    session = TrainingSession(args.redis_url, dataset=args.dataset, run=args.run,
                              store=args.store)
    ds = session.dataset(batch_size=args.batch_size,
                         collate=tokens if session.spec.format == "jsonl" else None)
    seq = (session.spec.sample_len or 65) - 1
    torch.manual_seed(args.seed)
    model = TinyGPT(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # The LR schedule spans the dataset: its steps come from the session.
    plan = session.progress()
    total = (plan.steps_per_epoch or 1) * (plan.epochs or 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(max(1, total // 10), total))
    state = {"model": model, "optim": opt, "sched": sched}
    step = session.restore(state)
    say(f"READY {step}")
    loader = DataLoader(ds, batch_size=None, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    saved = step
    for batch in session.batches(loader):
        x, y = batch.data[:, :-1], batch.data[:, 1:]
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        say(f"STEP {step} {loss.item():.4f} {loss.item().hex()}")
        if step % args.ckpt_every == 0:
            say(f"SAVE {step}")
            handle = session.checkpoint(state, step)  # written in the background
            handle.add_done_callback(lambda h, s=step: committed(h, s, say))
            saved = step
    if saved != step:  # commit the steps after the last periodic checkpoint
        say(f"SAVE {step}")
        session.checkpoint(state, step, blocking=True)
    session.close()
    say(f"DONE {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
