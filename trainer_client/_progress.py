"""Where the loop stands in its epoch: ``TrainingSession.progress()``.

Epoch sizes come from the streams themselves: a record's stream ID is
``<epoch + 1>-<index in its partition>``, so the last ID of an epoch in a partition
says how many records the partition holds in that epoch. That count is exact once
the producer has finished the epoch (``epochs_done`` in the progress hash), and a
lower bound before (the records produced so far; the previous epoch's count when it
is known, since every epoch of a source holds the same records).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from trainer_client._consumed import Snapshot
from trainer_client.dataset import StreamingDataset
from trainguard.core import streams

__all__ = ["EpochSizes", "Progress", "consumed_in_epoch", "measure", "steps_per_epoch"]

_MAX_SEQ = 2**64 - 1


@dataclass(frozen=True)
class Progress:
    """One rank's position in the current epoch (see ``TrainingSession.progress``)."""

    epoch: int
    """The epoch (from 0) of the newest batch the loop consumed; 0 before any."""
    batches: int
    """Batches this rank's loop consumed in ``epoch``."""
    records: int
    """Records of this rank's partitions consumed in ``epoch``."""
    remaining: int
    """Records of this rank's partitions in ``epoch`` not consumed yet."""
    steps_per_epoch: int | None
    """Loop iterations an epoch takes on every rank (the most any rank needs: ranks
    step together) for this world size, batch size and mode; None before
    ``session.dataset()``. Greedy mode pools each worker's partitions, so there it
    also depends on the worker count: the running ``batches()`` pass's (0 before)."""
    exact: bool
    """True when the producer has finished ``epoch``: ``remaining`` and
    ``steps_per_epoch`` are exact; else estimates from what was produced so far."""
    epochs: int | None
    """Epochs this run trains: ``session.dataset(epochs=...)``, else the dataset's
    (None: endless)."""


class EpochSizes:
    """Records per partition in an epoch, read from the streams (exact ones cached)."""

    def __init__(self, client: redis.Redis, dataset: str, partitions: int) -> None:
        self._client = client
        self._dataset = dataset
        self._partitions = partitions
        self._exact: dict[int, dict[int, int]] = {}

    def get(self, epoch: int) -> tuple[dict[int, int], bool]:
        if epoch in self._exact:
            return self._exact[epoch], True
        prog = self._client.hgetall(streams.progress_key(self._dataset))
        done = int(prog.get(streams.PROGRESS_EPOCHS_DONE, b"0") or 0)
        exact = done > epoch or prog.get(streams.PROGRESS_FINISHED) == b"1"
        pipe = self._client.pipeline(transaction=False)
        for p in range(self._partitions):
            pipe.xrevrange(streams.partition_key(self._dataset, p),
                           max=f"{epoch + 1}-{_MAX_SEQ}", min=f"{epoch + 1}-0", count=1)
        sizes = {}
        for p, got in enumerate(pipe.execute()):
            sizes[p] = streams.parse_id(got[0][0])[1] + 1 if got else 0
        if exact:
            self._exact[epoch] = sizes
        elif epoch - 1 in self._exact:
            prev = self._exact[epoch - 1]
            sizes = {p: max(n, prev[p]) for p, n in sizes.items()}
        return sizes, exact


def consumed_in_epoch(offset: str, epoch: int, size: int) -> int:
    """Records of a partition consumed in ``epoch`` when its offset is ``offset``."""
    ms, seq = streams.parse_id(offset)
    if ms - 1 == epoch:
        return seq + 1
    return size if ms - 1 > epoch else 0


def steps_per_epoch(
    sizes: Mapping[int, int], *, world_size: int, num_workers: int, batch_size: int,
    drop_last: bool,
) -> int:
    """Loop iterations of an epoch: per rank, the batches its workers cut (a
    worker's partitions pooled, in both modes: batches span partitions); the most of
    any rank, since ranks step together."""

    def batches(n: int) -> int:
        return n // batch_size if drop_last else -(-n // batch_size)

    partitions = len(sizes)
    most = 0
    for rank in range(world_size):
        total = 0
        for worker in range(max(1, num_workers)):
            owned = streams.assign_partitions(partitions, world_size=world_size,
                                              num_workers=num_workers, rank=rank, worker=worker)
            total += batches(sum(sizes[p] for p in owned))
        most = max(most, total)
    return most


def measure(
    now: Snapshot,
    sizes_of: Callable[[int], tuple[dict[int, int], bool]],
    mine: Sequence[int],
    *,
    world_size: int,
    num_workers: int,
    dataset: StreamingDataset | None,
    epochs: int | None,
) -> Progress:
    """This rank's :class:`Progress` from what it consumed (``now``), the epoch's
    partition sizes (``sizes_of(epoch)``: sizes and whether exact) and its partitions
    ``mine``; steps per epoch from ``dataset``'s batch size (None without one)."""
    epoch = max(now.epoch, 0)
    sizes, exact = sizes_of(epoch)
    done = sum(consumed_in_epoch(now.offsets[p], epoch, sizes[p]) for p in mine)
    steps = None
    if dataset is not None:
        steps = steps_per_epoch(sizes, world_size=world_size, num_workers=num_workers,
                                batch_size=dataset.batch_size,
                                drop_last=dataset.drop_last)
    return Progress(
        epoch=epoch,
        batches=now.epoch_batches if now.epoch == epoch else 0,
        records=done,
        remaining=max(0, sum(sizes[p] for p in mine) - done),
        steps_per_epoch=steps,
        exact=exact,
        epochs=dataset.epochs if dataset is not None and dataset.epochs else epochs,
    )
