"""A tiny GPT for the framework examples, and their exactly-once check.

``TinyGPT`` is a two-layer causal transformer over the bundled tokenizer's 512 tokens.
The examples train it on records that ``trainguard ingest --tokenizer ... --pack 65``
made: each record is 65 token ids, the input is the first 64 and the target the last
64. Beside the weights the model keeps a *ledger* (``seen``: sequences trained,
``checksum``: a sum of one hash per sequence), checkpointed with the weights, so after
kills and resumes :func:`expected` (the same over every record in Redis) says whether
each sequence was trained exactly once.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
import redis
import torch
import torch.distributed as dist
from torch import nn

from trainguard.core import settings, streams

VOCAB = 512
_MOD = 2_147_483_647  # the hash of one sequence stays far below 2**53: sums are exact


class TinyGPT(nn.Module):
    def __init__(self, context: int = 64, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.head = nn.Linear(width, VOCAB)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("checksum", torch.zeros((), dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.tok(ids) + self.pos(torch.arange(n))
        return self.head(self.blocks(h, mask=mask, is_causal=True))

    def loss(self, seqs: torch.Tensor) -> torch.Tensor:
        """Next-token loss of a ``[batch, 65]`` batch; counts it in the ledger."""
        self.count(seqs)
        logits = self(seqs[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1))

    @torch.no_grad()
    def count(self, seqs: torch.Tensor) -> None:
        """Add a batch (maybe empty: a rank out of data) to the ledger. Under several
        processes every rank must call it each step: it adds every rank's batch on
        every rank, since DDP overwrites every rank's buffers with rank 0's at each
        forward: only a ledger that is the same on every rank survives that."""
        local = torch.zeros(2, dtype=torch.float64)
        if len(seqs):
            local[0], local[1] = len(seqs), sequence_hashes(seqs).sum()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)  # integer-valued float64 sums far below 2**53: exact
        self.seen += int(local[0])
        self.checksum += local[1]


def sequence_hashes(seqs: torch.Tensor) -> torch.Tensor:
    weights = torch.arange(1, seqs.shape[1] + 1, dtype=torch.float64)
    return (seqs.double() * weights).sum(dim=1) % _MOD


def expected(redis_url: str, dataset: str) -> tuple[int, float]:
    """(sequences, checksum) over every record of the dataset in Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        spec = streams.DatasetSpec.from_redis(client.hgetall(streams.meta_key(dataset)))
        rows = [streams.decode_record(f) for p in range(spec.partitions)
                for _, f in client.xrange(streams.partition_key(dataset, p))]
    finally:
        client.close()
    seqs = torch.from_numpy(np.stack(rows)).long()
    return len(rows), float(sequence_hashes(seqs).sum())


def report(model: TinyGPT, redis_url: str, dataset: str) -> bool:
    count, checksum = expected(redis_url, dataset)
    ok = int(model.seen) == count and float(model.checksum) == checksum
    print(f"sequences trained: {int(model.seen)} of {count}; "
          + ("each exactly once (checksum matches)" if ok else "NOT exactly once"), flush=True)
    return ok


def parse_args(doc: str, run: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The examples' flags; also sets ``url`` (Redis) and ``root`` (this run's folder),
    and one torch thread (a tiny model: more threads cost more than they give)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--dataset", default="story")
    ap.add_argument("--run-name", "--run", dest="run", default=run,
                    help="the run's name (old spelling --run: torchrun takes it for its --run-path)")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "trainguard-examples"),
                    help="checkpoints go here (default: $TMPDIR/trainguard-examples)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at-step", type=int, default=None,
                    help="SIGKILL this process after that step (to show the resume)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.url = settings.redis_url(args.redis_url)
    args.root = Path(args.dir) / args.run
    return args
