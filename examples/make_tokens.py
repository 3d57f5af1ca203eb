"""Write a token dataset (JSON Lines ``{"id", "tokens"}``) and register it in Redis.

The same data ``trainguard demo`` trains on, at any size; ``examples/train_mlp.py``
consumes it. Used by ``docker compose --profile trainer`` (service ``example-data``)::

    python examples/make_tokens.py --out /data/tokens.jsonl --records 20000 \\
        --dataset demo --redis-url redis://127.0.0.1:6379/0

The ingest service then produces it into the dataset's partitions: the source path
must be readable by the service (in compose both mount the ``datasets`` volume).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import redis.asyncio as aioredis

from ingest_service.datasets import create_dataset
from trainguard.core.streams import DatasetSpec
from trainguard.core.urls import redact_url
from trainguard.ops.demo_stack import write_dataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON Lines file to write")
    p.add_argument("--records", type=int, default=20000)
    p.add_argument("--dataset", default=os.environ.get("TRAINGUARD_DATASET", "demo"))
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--redis-url",
                   default=os.environ.get("TRAINGUARD_REDIS_URL", "redis://127.0.0.1:6379/0"))
    return p.parse_args(argv)


async def register(args: argparse.Namespace, source: Path) -> None:
    r = aioredis.Redis.from_url(args.redis_url)
    try:
        await create_dataset(r, DatasetSpec(name=args.dataset, partitions=args.partitions,
                                            source=str(source), format="jsonl", seed=7))
    finally:
        await r.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if not out.exists():  # a re-run keeps the file the dataset was created from
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        write_dataset(tmp, args.records, args.seed)
        tmp.replace(out)
    asyncio.run(register(args, out))
    print(f"dataset {args.dataset!r}: {out} registered in {redact_url(args.redis_url)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
