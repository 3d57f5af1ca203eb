"""Tokenize-and-pack ingest benchmark: the producer against tokenizing alone.

In one run against one fresh redis-server (started here on a free port), on the
bundled text repeated ``--copies`` times (one document per line):

1. baseline: Hugging Face ``tokenizers`` ``encode_batch`` over the same documents in
   blocks, plus the packing (concatenate with EOS, cut into ``--pack`` tokens) in
   NumPy, in this process, nothing written anywhere: what tokenizing alone costs;
2. trainguard: ``Producer`` of the dataset with ``--tokenizer`` and ``--pack``
   (read, tokenize, pack, shuffle, deterministic IDs, XADD into Redis), with the
   tokenizing done in the producer's process (``processes=0``) and, when
   ``--processes`` > 0, in a pool of that many spawned processes.

Each round runs baseline then trainguard back to back (ABAB): the table shows the best
round of each in documents/s and sequences (records)/s, and the median and range of
each round's paired ratio. Not a test: on a shared 2-core machine rounds move a lot.
Usage: python bench/ingest_tokens.py [--copies 20] [--pack 129] [--rounds 3] [--processes 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from redis.asyncio import Redis  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ingest_service.datasets import delete_dataset  # noqa: E402
from ingest_service.producer.producer import Producer  # noqa: E402
from ingest_service.sources.tokens import tokenize_options  # noqa: E402
from tests.servers import RedisServer  # noqa: E402
from trainguard.core import settings, streams  # noqa: E402

TOKENIZER = ROOT / "examples" / "data" / "tokenizer.json"


def baseline(docs: list[str], pack: int) -> int:
    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = tok.token_to_id("<|endoftext|>")
    parts = []
    for i in range(0, len(docs), 256):
        for enc in tok.encode_batch(docs[i:i + 256], add_special_tokens=False):
            parts.append(np.asarray([*enc.ids, eos], dtype=np.int32))
    flat = np.concatenate(parts)
    return -(-len(flat) // pack)


async def trainguard(url: str, source: Path, pack: int, name: str) -> int:
    client = Redis.from_url(url)
    spec = streams.DatasetSpec(name=name, partitions=16, source=str(source), format="text",
                               options=tokenize_options(str(TOKENIZER), pack=pack))
    try:
        producer = Producer(client, spec)
        await producer.run()
        records = producer.progress.records
        await delete_dataset(client, name)
        return records
    finally:
        await client.aclose()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=20)
    ap.add_argument("--pack", type=int, default=129)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--processes", type=int, default=2)
    args = ap.parse_args()
    corpus = (ROOT / "examples" / "data" / "corpus.txt").read_text().splitlines()
    docs = corpus * args.copies
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "text.txt"
        source.write_text("\n".join(docs) + "\n")
        server = RedisServer(Path(tmp) / "redis").start()
        modes = [0] + ([args.processes] if args.processes > 0 else [])
        times: dict[str, list[float]] = {"baseline": [], **{f"tg p={m}": [] for m in modes}}
        seqs = 0
        try:
            for r in range(args.rounds):
                start = time.perf_counter()
                seqs = baseline(docs, args.pack)
                times["baseline"].append(time.perf_counter() - start)
                for m in modes:
                    os.environ[settings.TOKENIZE_PROCESSES_ENV] = str(m)
                    start = time.perf_counter()
                    got = asyncio.run(trainguard(server.url, source, args.pack, f"b{r}p{m}"))
                    times[f"tg p={m}"].append(time.perf_counter() - start)
                    assert got == seqs, (got, seqs)
        finally:
            server.kill()
    print(f"{len(docs):,} documents -> {seqs:,} sequences of {args.pack} tokens, "
          f"{args.rounds} rounds, {os.cpu_count()} cores")
    print(f"{'':12} {'docs/s (best)':>14} {'records/s (best)':>17}  ratio to baseline: "
          "median of rounds (range)")
    for name, ts in times.items():
        best = min(ts)
        ratios = [b / t for b, t in zip(times["baseline"], ts)]
        line = f"{name:12} {len(docs) / best:14,.0f} {seqs / best:17,.0f}"
        if name != "baseline":
            line += (f"  {statistics.median(ratios):.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
        print(line)


if __name__ == "__main__":
    main()
