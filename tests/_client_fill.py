"""Test helper: make a dataset the way the stream contract says, without the producer.

Record ``i`` of a dataset of ``n`` records goes to partition ``i % P`` with the
deterministic ID ``make_id(epoch, i // P)``; its payload is a NumPy ``int64`` array
``[i, i, ...]`` (``width`` long), so a consumer can tell which record it got.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from trainer_client import redis_client
from trainguard.core import streams


def create(url: str, name: str, *, partitions: int = 4, epochs: int | None = 1,
           sample_len: int = 8) -> streams.DatasetSpec:
    spec = streams.DatasetSpec(
        name=name, partitions=partitions, source="file:///nowhere", format="npy",
        sample_len=sample_len, epochs=epochs,
    )
    client = redis_client.client(url)
    try:
        client.hset(streams.meta_key(name), mapping=spec.to_redis())
        client.sadd(streams.datasets_key(), name)
    finally:
        client.close()
    return spec


def record(i: int, width: int = 8) -> np.ndarray:
    return np.full(width, i, dtype=np.int64)


def fill(
    url: str,
    spec: streams.DatasetSpec,
    n: int,
    *,
    start: int = 0,
    finish: bool = True,
    make: Callable[[int], Any] = record,
    chunk: int = 1000,
) -> None:
    """Append records ``start .. n-1``; with ``finish``, publish the end marks."""
    P = spec.partitions
    client = redis_client.client(url)
    try:
        for lo in range(start, n, chunk):
            pipe = client.pipeline(transaction=False)
            for i in range(lo, min(n, lo + chunk)):
                p, idx = i % P, i // P
                pipe.xadd(streams.partition_key(spec.name, p), streams.encode_record(make(i)),
                          id=streams.make_id(0, idx))
            pipe.execute()
        if finish:
            mark_finished(client, spec, n)
    finally:
        client.close()


def mark_finished(client: redis.Redis, spec: streams.DatasetSpec, n: int) -> None:
    P = spec.partitions
    fields: dict[bytes, bytes] = {streams.PROGRESS_FINISHED: b"1"}
    for p in range(P):
        count = len(range(p, n, P))
        if count:
            fields[streams.progress_end_field(p)] = streams.make_id(0, count - 1).encode()
    client.hset(streams.progress_key(spec.name), mapping=fields)
