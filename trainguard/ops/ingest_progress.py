"""The progress line of ``trainguard ingest``: the dataset's whole, this process's share.

Several producers (ingest or serve processes) may share a dataset's partitions, so
what this process appended is only its share. The dataset's own count comes from
Redis: a partition's last ID ``<epoch+1>-<index>`` says how many of its records are
there, because every epoch puts the same number of records in a partition (the
planner deals the epoch's good records round robin; the shuffle only reorders them).

The whole is ``records per epoch x epochs``: known from the start when the source
says its size up front (npy headers, files, Hugging Face row counts:
:mod:`trainguard.ops.source_size`), else once this process has planned one whole
epoch (:attr:`ProducerProgress.epoch_records`), or from the partitions' ends once the
dataset is finished. Until then the line says what it is waiting for rather
than guess a percentage (and a producer resumed past epoch 1 shows no dataset count
until it has read an epoch: an index alone no longer says how many records are in).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.core import streams

__all__ = ["DatasetCount", "count_dataset", "format_eta", "last_ids", "progress_line"]


@dataclass(frozen=True)
class DatasetCount:
    """Records of the dataset in Redis (all producers), and its whole when known."""

    done: int | None
    """None while unknown: a resumed producer past epoch 1 that has not read an epoch
    yet (a partition's index alone no longer says how many records it holds)."""
    whole: int | None
    """Records of every epoch together; None while unknown (or an endless dataset)."""
    epoch_records: int | None


async def last_ids(redis: Any, spec: streams.DatasetSpec) -> list[streams.StreamId | None]:
    """Each partition's last ID (None: nothing written yet), from ``XINFO STREAM``."""
    async with redis.pipeline(transaction=False) as pipe:
        for p in range(spec.partitions):
            pipe.xinfo_stream(streams.partition_key(spec.name, p))
        infos = await pipe.execute(raise_on_error=False)
    lasts: list[streams.StreamId | None] = []
    for info in infos:
        raw = info.get("last-generated-id") if isinstance(info, dict) else None
        last = streams.parse_id(raw) if raw else None
        lasts.append(None if last is None or last == (0, 0) else last)
    return lasts


def _per_partition(epoch_records: int, partitions: int, p: int) -> int:
    """Records partition ``p`` gets in every epoch (round robin over the partitions)."""
    return epoch_records // partitions + (1 if p < epoch_records % partitions else 0)


def count_dataset(lasts: Sequence[streams.StreamId | None], spec: streams.DatasetSpec, *,
                  epoch_records: int | None, finished: bool,
                  up_front: int | None = None) -> DatasetCount:
    """The dataset's records in Redis and its whole, from the partitions' last IDs.
    ``up_front``: an epoch's records as the source said before being read
    (:mod:`trainguard.ops.source_size`), used until the producer has its own count."""
    if epoch_records is None:
        epoch_records = up_front
    if epoch_records is None and finished:
        # Every partition ends in the last epoch: its index + 1 is its share of one.
        final = [last for last in lasts if last is not None]
        if final and len({ms for ms, _ in final}) == 1:
            epoch_records = sum(index + 1 for _, index in final)
    if epoch_records is None:
        written = [last for last in lasts if last is not None]
        if any(ms > 1 for ms, _ in written):
            return DatasetCount(done=None, whole=None, epoch_records=None)
        # All in the first epoch: the indexes count the records directly.
        return DatasetCount(done=sum(index + 1 for _, index in written), whole=None,
                            epoch_records=None)
    done = 0
    for p, last in enumerate(lasts):
        if last is not None:
            ms, index = last
            done += (ms - 1) * _per_partition(epoch_records, spec.partitions, p) + index + 1
    whole = epoch_records * spec.epochs if spec.finite and spec.epochs else None
    return DatasetCount(done=done, whole=whole, epoch_records=epoch_records)


def format_eta(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def progress_line(spec: streams.DatasetSpec, prog: Any, count: DatasetCount, *, state: str,
                  started: float, baseline: tuple[float, int] | None) -> str:
    """One line: the dataset's records of its whole with a percentage and an ETA (when
    the whole is known), then this process's share, labelled as such. ``started``: when
    this process began; ``baseline``: (when, dataset count) the first time the count was
    known, which the ETA's rate is measured from (every producer's records count)."""
    now = time.monotonic()
    elapsed = max(now - started, 1e-9)
    epochs = f"{prog.epoch + 1}/{spec.epochs}" if spec.finite else f"{prog.epoch + 1}/endless"
    if count.done is None:
        dataset = "dataset count known once an epoch of the source is read"
    elif count.whole is not None:
        pct = 100.0 if count.whole == 0 else 100 * count.done / count.whole
        since, base = baseline or (started, count.done)
        rate = (count.done - base) / max(now - since, 1e-9)
        left = count.whole - count.done
        eta = "0:00:00" if left <= 0 else (format_eta(left / rate) if rate > 0 else "unknown")
        dataset = f"dataset {count.done:,}/{count.whole:,} records ({pct:.1f} %)  ETA {eta}"
    elif not spec.finite and count.epoch_records is not None:
        dataset = f"dataset {count.done:,} records ({count.epoch_records:,} per epoch, endless)"
    else:
        dataset = f"dataset {count.done:,} records (the whole is known once an epoch is read)"
    paused = f" paused {sorted(prog.paused)}" if prog.paused else ""
    return (
        f"{spec.name}: {state} epoch {epochs}  {dataset}  |  this process: "
        f"{prog.records:,} records  {prog.bytes / 1e6:,.1f} MB  {prog.records / elapsed:,.0f} rec/s  "
        f"dead letters {prog.dead_letters}{paused}"
    )
