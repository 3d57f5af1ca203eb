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
``shuffle_buffer_bytes`` of payload), one chunk and one block of source records
(about a chunk's bytes).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ingest_service.sources.records import BadRecord, GoodRecord, SourceItem
from ingest_service.sources.tokens import dataset_items
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
_DATA = operator.attrgetter("data")


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


_STEADY_BITS = 32
"""The bulk draws below read the generator's 32-bit words directly: only for a
buffer of fewer than 2**32 records (every real one)."""


def _bulk_draws(rng: random.Random, n: int, k: int) -> list[int]:
    """The next ``k`` values of ``_below(rng.getrandbits, n)``, and the generator left
    exactly where ``k`` such calls leave it, from a few C-level draws.

    ``getrandbits(b)`` for ``b <= 32`` is the top ``b`` bits of one 32-bit word of the
    Mersenne Twister, and ``getrandbits(32 * w)`` is the next ``w`` words, the first
    one least significant; so a bulk draw, cut into words, is the stream of single
    draws. The bulk draw takes a guess at how many words the rejections need; the
    state is then reset and advanced by exactly the words used."""
    bits = n.bit_length()
    state = rng.getstate()
    words = k * (1 << bits) // n + 64
    while True:
        raw = rng.getrandbits(32 * words).to_bytes(4 * words, "little")
        vals = np.frombuffer(raw, dtype="<u4") >> np.uint32(32 - bits)
        hits = np.flatnonzero(vals < n)
        if len(hits) >= k:
            break
        rng.setstate(state)
        words *= 2
    used = int(hits[k - 1]) + 1 if k else 0
    rng.setstate(state)
    if used:
        rng.getrandbits(32 * used)
    return vals[hits[:k]].tolist()  # type: ignore[no-any-return]


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

    Records are taken from ``items`` in blocks of about one chunk's bytes. A block of
    good records that arrives at a full buffer and cannot reach the byte bound (the
    steady state) takes one draw per record, all drawn at once (:func:`_bulk_draws`),
    and is cut into chunks by C-level searches; any other block goes record by record.
    Both give the same order and the same chunks.
    """
    rng = shuffle_rng(seed, epoch)
    getrandbits = rng.getrandbits
    shuffle = shuffle_buffer > 1
    steady = shuffle and (shuffle_buffer + 1).bit_length() <= _STEADY_BITS
    buf: list[GoodRecord] = []
    held = 0
    out: list[GoodRecord] = []
    out_bytes = 0
    dead: list[PlannedDeadLetter] = []
    bad = 0
    first = 0
    source = iter(items)
    block_len = 1
    while block := list(itertools.islice(source, block_len)):
        if not any(map(isinstance, block, itertools.repeat(BadRecord))):
            good = cast(list[GoodRecord], block)
            sizes = list(map(len, map(_DATA, good)))
            block_len = max(1, min(CHUNK_RECORDS, chunk_bytes * len(block) // max(1, sum(sizes))))
            if not shuffle or (steady and len(buf) == shuffle_buffer
                               and held + sum(sizes) <= shuffle_buffer_bytes):
                if shuffle:
                    emitted: list[GoodRecord] = []
                    emit = emitted.append
                    last = shuffle_buffer
                    # buf.append(item), then buf[j] out, swapped with the last: in place.
                    for rec, j in zip(good, _bulk_draws(rng, shuffle_buffer + 1, len(good))):
                        if j == last:
                            emit(rec)
                        else:
                            emit(buf[j])
                            buf[j] = rec
                    out_sizes = list(map(len, map(_DATA, emitted)))
                    held += sum(sizes) - sum(out_sizes)
                else:
                    emitted, out_sizes = good, sizes
                # Cut where the per-record loop would: after the record that brings the
                # chunk to chunk_records records or chunk_bytes bytes.
                cum = list(itertools.accumulate(out_sizes))
                lo = 0
                while lo < len(emitted):
                    before = cum[lo - 1] if lo else 0
                    by_bytes = bisect.bisect_left(cum, chunk_bytes - out_bytes + before, lo)
                    cut = min(lo + chunk_records - len(out) - 1, by_bytes)
                    if cut >= len(emitted):
                        out += emitted[lo:]
                        out_bytes += cum[-1] - before
                        break
                    out += emitted[lo : cut + 1]
                    yield PlanChunk(first, out, dead)
                    first += len(out)
                    out, out_bytes, dead = [], 0, []
                    lo = cut + 1
                continue
        # This loop is the producer's inner loop outside the steady state: fast locals,
        # no Python-level call per record (hence the chunk cut written out twice rather
        # than a closure).
        for item in block:
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
        nbytes = sum(len(i.payload) if isinstance(i, BadRecord) else len(i.data) for i in block)
        block_len = max(1, min(CHUNK_RECORDS, chunk_bytes * len(block) // max(1, nbytes)))
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
