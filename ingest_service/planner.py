"""Where each record of an epoch goes: a pure function of (source, seed, epoch).

The source's records pass through a seeded shuffle buffer (``spec.shuffle_buffer``
records; the generator is seeded from the dataset seed and the epoch), then go round
robin over the partitions: the k-th record out of the shuffle goes to partition
``k % P`` as its ``k // P``-th record, with ID ``make_id(epoch, k // P)``. Bad records
skip the shuffle and get their own running number in the epoch, which is their
dead-letter ID, so dead letters are exactly-once as well.

Memory: the shuffle buffer, nothing else.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ingest_service.sources import BadRecord, GoodRecord, SourceItem

__all__ = ["Planned", "PlannedDeadLetter", "plan_epoch", "shuffle_rng"]


@dataclass(frozen=True, slots=True)
class Planned:
    partition: int
    index: int
    fields: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class PlannedDeadLetter:
    index: int
    record: BadRecord


def shuffle_rng(seed: int, epoch: int) -> random.Random:
    # Seeding with a str goes through SHA-512: the same in every process and Python
    # version, independent of PYTHONHASHSEED.
    return random.Random(f"trainguard-shuffle:{seed}:{epoch}")


def _shuffled(items: Iterable[GoodRecord], rng: random.Random, size: int) -> Iterator[GoodRecord]:
    if size <= 1:
        yield from items
        return
    buf: list[GoodRecord] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(size)
        out, buf[j] = buf[j], item
        yield out
    rng.shuffle(buf)
    yield from buf


def plan_epoch(
    items: Iterable[SourceItem], *, partitions: int, seed: int, epoch: int, shuffle_buffer: int
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
    for k, rec in enumerate(_shuffled(good(), shuffle_rng(seed, epoch), shuffle_buffer)):
        if dead_letters:
            yield from dead_letters
            dead_letters.clear()
        yield Planned(k % partitions, k // partitions, rec.fields)
    yield from dead_letters

