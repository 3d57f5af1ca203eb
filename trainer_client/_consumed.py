"""What the training loop consumed: the state a checkpoint commits with the weights.

Per partition, the last stream ID the loop consumed and the batches it took from it
(deterministic mode orders batches by them); for this rank, the epoch of the newest
batch and the batches consumed in it; and how many reading passes ran since the
last restore (none: a checkpoint checks that nothing was read around the session).
The session's loop records into it, and ``checkpoint`` (any thread) reads a
consistent snapshot of it under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainer_client.batch import Batch
from trainguard.core import streams
from trainguard.core.record import RankState

__all__ = ["Consumed", "Snapshot"]


@dataclass(frozen=True)
class Snapshot:
    offsets: dict[int, str]
    batches: dict[int, int]
    epoch: int
    epoch_batches: int
    passes: int


class Consumed:
    """The consumption ledger of one session (see the module docstring)."""

    def __init__(self, partitions: int) -> None:
        self._lock = threading.Lock()
        self._offsets = {p: streams.ZERO_ID for p in range(partitions)}
        self._batches = {p: 0 for p in range(partitions)}
        self._epoch = -1
        self._epoch_batches = 0
        self._passes = 0

    def reset(self, offsets: Mapping[int, str], batches: Mapping[int, int],
              rank: RankState | None) -> None:
        """Back to a checkpoint's (or, with no checkpoint, the start's) position."""
        with self._lock:
            self._offsets = {p: offsets.get(p, streams.ZERO_ID) for p in self._offsets}
            self._batches = {p: batches.get(p, 0) for p in self._batches}
            if rank is not None:
                self._epoch, self._epoch_batches = rank.epoch, rank.epoch_batches
            self._passes = 0

    def place(self, offsets: Mapping[int, str], batches: Mapping[int, int],
              rank: RankState | None = None) -> None:
        """Set these partitions' positions (read from a checkpoint after a reset), and
        with ``rank`` the epoch position."""
        with self._lock:
            self._offsets.update(offsets)
            self._batches.update(batches)
            if rank is not None:
                self._epoch, self._epoch_batches = rank.epoch, rank.epoch_batches

    def record(self, batch: Batch) -> None:
        """``batch`` was handed to the loop (or, dropped, consumed unseen): its offsets
        and counts are consumed; the first batch of a newer epoch gets ``new_epoch``."""
        with self._lock:
            for p, i in batch.offsets.items():
                self._offsets[p] = i
            if batch.partition >= 0:
                self._batches[batch.partition] += 1
            if batch.dropped or not batch.ids:
                return
            if batch.epoch > self._epoch:
                self._epoch, self._epoch_batches = batch.epoch, 0
                batch.new_epoch = True
            if batch.epoch == self._epoch:
                self._epoch_batches += 1

    def start_pass(self, mine: Iterable[int]) -> tuple[dict[int, str], dict[int, int]]:
        """A reading pass starts: where each of ``mine`` stands (ID, batches)."""
        with self._lock:
            self._passes += 1
            return ({p: self._offsets[p] for p in mine}, {p: self._batches[p] for p in mine})

    def seek_table(self) -> dict[int, tuple[str, int]]:
        """Every partition's ``(last consumed ID, batches)``: a dataset's seek."""
        with self._lock:
            return {p: (self._offsets[p], self._batches[p]) for p in self._offsets}

    def snapshot(self) -> Snapshot:
        with self._lock:
            return Snapshot(dict(self._offsets), dict(self._batches), self._epoch,
                            self._epoch_batches, self._passes)
