"""Where each record of an epoch goes: a pure function of (source, seed, epoch).

The source's records pass through a seeded shuffle buffer (``spec.shuffle_buffer``
records; the generator is seeded from the dataset seed and the epoch), then go round
robin over the partitions: the k-th record out of the shuffle goes to partition
``k % P`` as its ``k // P``-th record, with ID ``make_id(epoch, k // P)``. Bad records
skip the shuffle and get their own running number in the epoch, which is their
dead-letter ID, so dead letters are exactly-once as well.

The order is part of a dataset's identity: a producer restarted by a newer trainguard
must re-plan the same order, or a resumed partition would get records twice and miss
others. So the draws are written out here (rejection sampling on ``getrandbits``, the
same draws CPython's ``randrange`` and ``shuffle`` make today), not left to whatever a
future Python's ``random`` does; ``test_planner_order_is_pinned`` holds them.

The planner hands out :class:`PlanChunk` s, runs of consecutive records, so that the
producer splits them over partitions with one slice each instead of a step per record.

Memory: the shuffle buffer (``spec.shuffle_buffer`` records, at most
``shuffle_buffer_bytes`` of payload) and one chunk.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ingest_service.sources import BadRecord, GoodRecord, SourceItem
from ingest_service.tokens import dataset_items
from trainguard.core import streams

__all__ = [
    "DEFAULT_SHUFFLE_BUFFER_BYTES",
    "PlanChunk",
    "Planned",
    "PlannedDeadLetter",
    "plan_chunks",
    "plan_epoch",
    "plan_spec_chunks",
    "plan_spec_epoch",
    "shuffle_rng",
]

DEFAULT_SHUFFLE_BUFFER_BYTES = 64 * 1024 * 1024
"""Payload bytes the shuffle buffer may hold, unless the dataset's
``options["shuffle_buffer_bytes"]`` says otherwise (it is part of the dataset, because
the order depends on it)."""

CHUNK_RECORDS = 1024
CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class PlannedDeadLetter:
    index: int
    record: BadRecord


@dataclass(slots=True)
class PlanChunk:
    """Consecutive planned records: ``records[i]`` is the epoch's record number
    ``first + i``; plus the dead letters met while they were planned."""

    first: int
    records: list[GoodRecord]
    dead: list[PlannedDeadLetter]

    def by_partition(self, partitions: int) -> Iterator[tuple[int, int, list[GoodRecord]]]:
        """(partition, index in it of the first one, records) for every partition that
        gets records of this chunk, each partition's records in order: one slice each,
        and no step at all for the partitions that get none (more partitions than
        records)."""
        records = self.records
        for offset in range(min(partitions, len(records))):
            k = self.first + offset
            yield k % partitions, k // partitions, records[offset::partitions]


@dataclass(frozen=True, slots=True)
class Planned:
    """One planned record (the per-record view of :func:`plan_epoch`)."""

    partition: int
    index: int
    record: GoodRecord

    @property
    def fields(self) -> dict[bytes, bytes]:
        return self.record.fields


def shuffle_rng(seed: int, epoch: int) -> random.Random:
    # Seeding with a str goes through SHA-512: the same in every process and Python
    # version, independent of PYTHONHASHSEED.
    return random.Random(f"trainguard-shuffle:{seed}:{epoch}")


def _below(getrandbits: Any, n: int) -> int:
    """A uniform integer in [0, n), n >= 1: draw n.bit_length() bits until below n."""
    bits = n.bit_length()
    r: int = getrandbits(bits)
    while r >= n:
        r = getrandbits(bits)
    return r


def plan_chunks(
    items: Iterable[SourceItem], *, seed: int, epoch: int, shuffle_buffer: int,
    shuffle_buffer_bytes: int = DEFAULT_SHUFFLE_BUFFER_BYTES,
    chunk_records: int = CHUNK_RECORDS, chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[PlanChunk]:
    """The epoch's records in planned order, in chunks of about ``chunk_records``
    records or ``chunk_bytes`` payload bytes.

    The shuffle buffer: each arriving record goes in, and while the buffer holds more
    than ``shuffle_buffer`` records or ``shuffle_buffer_bytes`` payload bytes (one
    record over the byte bound still passes alone), a uniformly drawn one comes out
    (swapped with the last, then popped). At the end the rest is shuffled (Fisher-Yates
    from the back) and comes out in that order.
    """
    getrandbits = shuffle_rng(seed, epoch).getrandbits
    shuffle = shuffle_buffer > 1
    buf: list[GoodRecord] = []
    held = 0
    out: list[GoodRecord] = []
    out_bytes = 0
    dead: list[PlannedDeadLetter] = []
    bad = 0
    first = 0
    # This loop is the producer's inner loop: fast locals, no Python-level call per record
    # (hence the chunk cut written out twice rather than a closure).
    for item in items:
        if item.__class__ is BadRecord:
            dead.append(PlannedDeadLetter(bad, item))  # type: ignore[arg-type]
            bad += 1
        elif not shuffle:
            out.append(item)  # type: ignore[arg-type]
            out_bytes += len(item.data)  # type: ignore[union-attr]
        else:
            buf.append(item)  # type: ignore[arg-type]
            held += len(item.data)  # type: ignore[union-attr]
            n = len(buf)
            while n > shuffle_buffer or (held > shuffle_buffer_bytes and n > 1):
                bits = n.bit_length()  # _below, inlined
                j = getrandbits(bits)
                while j >= n:
                    j = getrandbits(bits)
                rec = buf[j]
                buf[j] = buf[-1]
                buf.pop()
                n -= 1
                size = len(rec.data)
                held -= size
                out.append(rec)
                out_bytes += size
        # A run of bad records makes a chunk too: dead letters are bounded as well.
        if len(out) >= chunk_records or out_bytes >= chunk_bytes or len(dead) >= chunk_records:
            yield PlanChunk(first, out, dead)
            first += len(out)
            out, out_bytes, dead = [], 0, []
    for i in range(len(buf) - 1, 0, -1):
        j = _below(getrandbits, i + 1)
        buf[i], buf[j] = buf[j], buf[i]
    for rec in buf:
        out.append(rec)
        out_bytes += len(rec.data)
        if len(out) >= chunk_records or out_bytes >= chunk_bytes:
            yield PlanChunk(first, out, dead)
            first += len(out)
            out, out_bytes, dead = [], 0, []
    if out or dead:
        yield PlanChunk(first, out, dead)


def plan_epoch(
    items: Iterable[SourceItem], *, partitions: int, seed: int, epoch: int, shuffle_buffer: int,
    shuffle_buffer_bytes: int = DEFAULT_SHUFFLE_BUFFER_BYTES,
) -> Iterator[Planned | PlannedDeadLetter]:
    """:func:`plan_chunks` one record at a time, each with its partition and index."""
    chunks = plan_chunks(items, seed=seed, epoch=epoch, shuffle_buffer=shuffle_buffer,
                         shuffle_buffer_bytes=shuffle_buffer_bytes)
    while (chunk := next(chunks, None)) is not None:
        yield from chunk.dead
        for k, rec in enumerate(chunk.records, chunk.first):
            yield Planned(k % partitions, k // partitions, rec)
            del rec
        del chunk  # not held while the next chunk is planned: memory is one chunk


def _spec_options(spec: streams.DatasetSpec) -> dict[str, int]:
    return {
        "seed": spec.seed,
        "shuffle_buffer": spec.shuffle_buffer,
        "shuffle_buffer_bytes": int(
            spec.options.get("shuffle_buffer_bytes", DEFAULT_SHUFFLE_BUFFER_BYTES)
        ),
    }


def plan_spec_chunks(
    spec: streams.DatasetSpec, epoch: int, storage_options: Mapping[str, Any] | None = None
) -> Iterator[PlanChunk]:
    """:func:`plan_chunks` over the dataset's own source and settings."""
    return plan_chunks(dataset_items(spec, storage_options), epoch=epoch, **_spec_options(spec))


def plan_spec_epoch(
    spec: streams.DatasetSpec, epoch: int, storage_options: Mapping[str, Any] | None = None
) -> Iterator[Planned | PlannedDeadLetter]:
    """:func:`plan_epoch` over the dataset's own source and settings."""
    return plan_epoch(dataset_items(spec, storage_options), partitions=spec.partitions,
                      epoch=epoch, **_spec_options(spec))
