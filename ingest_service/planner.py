"""Where each record of an epoch goes: a pure function of (source, seed, epoch).

The source's records pass through a seeded shuffle buffer (``spec.shuffle_buffer``
records; the generator is seeded from the dataset seed and the epoch), then go round
robin over the partitions: the k-th record out of the shuffle goes to partition
``k % P`` as its ``k // P``-th record, with ID ``make_id(epoch, k // P)``. Bad records
skip the shuffle and get their own running number in the epoch, which is their
dead-letter ID, so dead letters are exactly-once as well.

Memory: the shuffle buffer (``spec.shuffle_buffer`` records, at most
``shuffle_buffer_bytes`` of payload), nothing else.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ingest_service.sources import BadRecord, GoodRecord, SourceItem, read_source
from trainguard import streams

__all__ = [
    "DEFAULT_SHUFFLE_BUFFER_BYTES",
    "Planned",
    "PlannedDeadLetter",
    "plan_epoch",
    "plan_spec_epoch",
    "shuffle_rng",
]

DEFAULT_SHUFFLE_BUFFER_BYTES = 64 * 1024 * 1024
"""Payload bytes the shuffle buffer may hold, unless the dataset's
``options["shuffle_buffer_bytes"]`` says otherwise (it is part of the dataset, because
the order depends on it)."""


@dataclass(frozen=True, slots=True)
class Planned:
    partition: int
    index: int
    fields: dict[bytes, bytes]
    size: int
    """Payload bytes (the ``F_DATA`` field), counted once here for every later bound."""


@dataclass(frozen=True, slots=True)
class PlannedDeadLetter:
    index: int
    record: BadRecord


def shuffle_rng(seed: int, epoch: int) -> random.Random:
    # Seeding with a str goes through SHA-512: the same in every process and Python
    # version, independent of PYTHONHASHSEED.
    return random.Random(f"trainguard-shuffle:{seed}:{epoch}")


def _size(item: GoodRecord) -> int:
    return len(item.fields.get(streams.F_DATA, b""))


def _shuffled(
    items: Iterable[GoodRecord], rng: random.Random, size: int, max_bytes: int
) -> Iterator[tuple[int, GoodRecord]]:
    """A shuffle buffer of at most ``size`` records and ``max_bytes`` payload bytes (one
    record over the byte bound still passes alone): each arriving record goes in, and
    while the buffer is over a bound, a uniformly chosen record comes out. Yields
    (payload bytes, record): each record's size is counted once."""
    if size <= 1:
        for item in items:
            yield _size(item), item
        return
    # Entries are (size, record) pairs; the generator's draws depend only on the
    # buffer's length, so the order is the same as for a buffer of bare records.
    buf: list[tuple[int, GoodRecord]] = []
    held = 0
    randrange = rng.randrange
    for item in items:
        n = _size(item)
        buf.append((n, item))
        held += n
        while len(buf) > size or (held > max_bytes and len(buf) > 1):
            j = randrange(len(buf))
            out = buf[j]
            buf[j] = buf[-1]
            buf.pop()
            held -= out[0]
            yield out
    rng.shuffle(buf)
    yield from buf


def plan_epoch(
    items: Iterable[SourceItem], *, partitions: int, seed: int, epoch: int, shuffle_buffer: int,
    shuffle_buffer_bytes: int = DEFAULT_SHUFFLE_BUFFER_BYTES,
) -> Iterator[Planned | PlannedDeadLetter]:
    dead = 0

    def good() -> Iterator[GoodRecord]:
        nonlocal dead
        for item in items:
            if isinstance(item, GoodRecord):
                yield item
            else:
                dead_letters.append(PlannedDeadLetter(dead, item))
                dead += 1

    dead_letters: list[PlannedDeadLetter] = []
    shuffled = _shuffled(good(), shuffle_rng(seed, epoch), shuffle_buffer, shuffle_buffer_bytes)
    for k, (size, rec) in enumerate(shuffled):
        if dead_letters:
            yield from dead_letters
            dead_letters.clear()
        yield Planned(k % partitions, k // partitions, rec.fields, size)
    yield from dead_letters



def plan_spec_epoch(
    spec: streams.DatasetSpec, epoch: int, storage_options: Mapping[str, Any] | None = None
) -> Iterator[Planned | PlannedDeadLetter]:
    """:func:`plan_epoch` over the dataset's own source and settings."""
    return plan_epoch(
        read_source(spec, storage_options), partitions=spec.partitions, seed=spec.seed,
        epoch=epoch, shuffle_buffer=spec.shuffle_buffer,
        shuffle_buffer_bytes=int(
            spec.options.get("shuffle_buffer_bytes", DEFAULT_SHUFFLE_BUFFER_BYTES)
        ),
    )
