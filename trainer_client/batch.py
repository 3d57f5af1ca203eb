"""``Batch``: the records of one batch and where each came from, as the session
records them consumed; and how a batch crosses between processes (a worker's batch
tensor travels as a slot of its shared ring, see :mod:`trainer_client._batch_ring`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from multiprocessing.reduction import ForkingPickler
from typing import Any

from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from trainer_client import _batch_ring

__all__ = ["Batch"]


@dataclass
class Batch:
    """Records of one batch and where they came from.

    ``data`` is a tensor ``[n, ...]`` when every record is a NumPy array of one dtype
    and shape (copied once, straight from the Redis reply into the batch tensor), the
    ``collate`` result when one was given, else the list of decoded records; None in
    the empty batches ``TrainingSession.batches`` hands a rank that ran out of data
    while others still train (``len(batch) == 0``).
    ``ids`` maps partition -> stream IDs of its records here, in stream order;
    ``offsets`` maps partition -> the last of them; ``pos`` lists each record's
    source position (``path:line``, ``path:token_index``; see the stream contract)
    in the order of ``data``, or None when the records carry none.
    ``epoch`` is the epoch (from 0) of the batch's records: a batch never holds two
    epochs unless the dataset was made with ``straddle_epochs=True`` (then it is the
    first record's epoch); -1 for an empty batch. ``new_epoch`` is set by
    ``TrainingSession.batches`` on the first batch of each epoch it yields. Workers
    (and ranks) reach an epoch's end at different times, so with several of them the
    last batches of one epoch may come after the first of the next.
    In deterministic mode ``partition`` is the one partition of the batch and ``seq``
    its index among its worker's batches.
    """

    data: Any
    ids: dict[int, list[str]]
    offsets: dict[int, str]
    worker: int = 0
    partition: int = -1
    seq: int = -1
    epoch: int = -1
    pos: list[str] | None = None
    new_epoch: bool = False
    final: bool = False
    """Deterministic mode: the worker's end-of-pass marker (no records)."""
    dropped: bool = False
    """A short batch at an epoch's end with ``drop_last``: consumed, never yielded."""

    def __len__(self) -> int:
        return sum(len(v) for v in self.ids.values())

    def pin_memory(self, device: Any = None) -> Batch:
        """This batch with its data in pinned memory (what ``DataLoader(pin_memory=True)``
        calls in its pin-memory thread; without it torch would pass a Batch through
        unpinned). A ring slot is released as soon as its pinned copy is made."""
        return replace(self, data=_pin_memory(self.data, device))  # type: ignore[no-untyped-call]


def _rebuild_batch(state: dict[str, Any]) -> Batch:
    batch = Batch.__new__(Batch)
    batch.__dict__.update(state)
    return batch


def _reduce_batch(batch: Batch) -> tuple[Any, ...]:
    """How a Batch crosses between processes (DataLoader queues): a worker's batch
    tensor in its ring goes as a slot handle (see trainer_client._batch_ring). Only
    multiprocessing's pickler does this; ``pickle`` and ``copy`` see a plain Batch."""
    return (_rebuild_batch, ({**batch.__dict__, "data": _batch_ring.reduce_data(batch.data)},))


ForkingPickler.register(Batch, _reduce_batch)
