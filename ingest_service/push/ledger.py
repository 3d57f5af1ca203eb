"""What this service acknowledged, remembered, so that a Redis that comes back older
is caught: :class:`AckLedger`.

For pushed records Redis is the only copy. A Redis restarted from an older RDB
snapshot, or without persistence, comes back without batches the service answered
200 for, and nothing in Redis says so: the producers' marks simply went back. So the
service remembers, per partition, the highest count of whole batches it saw
(``:acked`` in the partition's seq hash, raised by the append script) and, per
producer, the highest seq it acknowledged. A Redis that shows less lost them:

- the service logs an ERROR naming the dataset, partitions and producers;
- the dataset is reported ``lost_acknowledged_data`` in ``/readyz`` and the admin API
  (what was lost, by producer and seq), until the service restarts;
- the producer's next push is answered 409 ``lost_acknowledged_data`` with the seqs
  lost (:class:`~ingest_service.errors.PushDataLostError`), once: the ledger then
  takes Redis' mark as the producer's, so the producer can go on from there.

The memory is this process': a service restarted together with Redis cannot tell,
and several services each catch what they acknowledged themselves. Entries are a few
numbers per partition and producer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ingest_service.errors import PushDataLostError

__all__ = ["ACKED_FIELD", "AckLedger", "DatasetLoss"]

log = logging.getLogger(__name__)

ACKED_FIELD = ":acked"
"""The seq hash field counting a partition's whole batches (':' is not allowed in a
producer_id, so it never collides with a mark)."""


@dataclass
class DatasetLoss:
    """What a dataset lost of what this service acknowledged."""

    detected_at: float
    partitions: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Partition -> (batches acknowledged, batches Redis holds)."""
    producers: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    """producer_id -> (last seq acknowledged, its mark in Redis: None, none): the seqs
    after the mark up to the acknowledged one are lost."""

    def as_json(self) -> dict[str, object]:
        return {
            "detected_at": self.detected_at,
            "partitions": {str(p): {"acknowledged_batches": a, "found_batches": f}
                           for p, (a, f) in sorted(self.partitions.items())},
            "producers": {pid: {"acknowledged_seq": a, "mark": m,
                                "lost_seqs": [0 if m is None else m + 1, a]}
                          for pid, (a, m) in sorted(self.producers.items())},
        }


class AckLedger:
    """The highest acknowledged counts and marks this process saw, and the losses
    found against them."""

    def __init__(self) -> None:
        # Each remembered value with the tick it was raised at: a read of Redis issued
        # before that tick may predate the write (a concurrent push), so only reads
        # issued after it are compared with it.
        self._batches: dict[tuple[str, int], tuple[int, int]] = {}
        self._marks: dict[tuple[str, str], tuple[int, int]] = {}
        self._ticks = 0
        self.losses: dict[str, DatasetLoss] = {}

    def tick(self) -> int:
        """Taken before a read of Redis, passed to the checks of what it read."""
        self._ticks += 1
        return self._ticks

    def forget(self, dataset: str) -> None:
        """The dataset was deleted on purpose: what it held is not a loss."""
        self._batches = {k: v for k, v in self._batches.items() if k[0] != dataset}
        self._marks = {k: v for k, v in self._marks.items() if k[0] != dataset}
        self.losses.pop(dataset, None)

    def acknowledged(self, dataset: str, partition: int, producer_id: str, seq: int,
                     batches: int) -> None:
        """A batch is answered 200: ``batches`` is the partition's count after it (0:
        not known, the batch was found in already)."""
        key = (dataset, producer_id)
        if seq > self._marks.get(key, (-1, 0))[0]:
            self._marks[key] = (seq, self.tick())
        part = (dataset, partition)
        if batches > self._batches.get(part, (0, 0))[0]:
            self._batches[part] = (batches, self.tick())

    def _loss(self, dataset: str) -> DatasetLoss:
        loss = self.losses.get(dataset)
        if loss is None:
            loss = self.losses[dataset] = DatasetLoss(detected_at=time.time())
        return loss

    def check_partition(self, dataset: str, partition: int, found: int, read_at: int) -> None:
        """Redis says the partition holds ``found`` whole batches (read after tick
        ``read_at``)."""
        remembered, raised_at = self._batches.get((dataset, partition), (0, 0))
        if found >= remembered or raised_at >= read_at:
            return
        self._loss(dataset).partitions[partition] = (remembered, found)
        self._batches[(dataset, partition)] = (found, self.tick())
        log.error("Redis lost acknowledged pushes: partition %d of dataset %r holds %d "
                  "whole batches, this service acknowledged %d (Redis restarted from an "
                  "older snapshot or without persistence); the dataset is marked "
                  "lost_acknowledged_data", partition, dataset, found, remembered)

    def check_mark(self, dataset: str, producer_id: str, mark: int | None, read_at: int) -> None:
        """Redis says the producer's mark is ``mark`` (read after tick ``read_at``);
        raises PushDataLostError (once) when it is below what this service
        acknowledged."""
        key = (dataset, producer_id)
        remembered = self._marks.get(key)
        if remembered is None or (mark is not None and mark >= remembered[0]) \
                or remembered[1] >= read_at:
            return
        acked = remembered[0]
        self._loss(dataset).producers[producer_id] = (acked, mark)
        if mark is None:
            del self._marks[key]
        else:
            self._marks[key] = (mark, self.tick())
        first = 0 if mark is None else mark + 1
        log.error("Redis lost acknowledged pushes: producer %r of dataset %r has mark %s, "
                  "this service acknowledged up to seq %d: seqs %d..%d are lost",
                  producer_id, dataset, mark, acked, first, acked)
        raise PushDataLostError(
            f"Redis lost batches of producer {producer_id!r} that this service acknowledged: "
            f"seqs {first} to {acked} (Redis restarted from an older snapshot or without "
            f"persistence; the dataset {dataset!r} is marked lost_acknowledged_data). Their "
            f"records are not in the stream: send them again if you still have them; the "
            f"producer goes on from seq {first}",
            mark=mark, acknowledged=acked)

    def partitions(self) -> list[tuple[str, int]]:
        return sorted(self._batches)

    def producers(self, dataset: str) -> list[str]:
        return sorted(pid for d, pid in self._marks if d == dataset)

    def status(self) -> dict[str, dict[str, object]]:
        """``{dataset: loss}`` for /readyz and the admin API."""
        return {name: loss.as_json() for name, loss in sorted(self.losses.items())}

    def missing_dataset(self, dataset: str, read_at: int) -> None:
        """Redis has no such dataset (read after tick ``read_at``), although this
        service acknowledged pushes to it (a Redis restarted empty)."""
        if not any(d == dataset and t < read_at for (d, _), (_, t) in self._batches.items()):
            return
        loss = self._loss(dataset)
        for (d, p), (n, _) in list(self._batches.items()):
            if d == dataset:
                loss.partitions[p] = (n, 0)
                del self._batches[(d, p)]
        log.error("Redis lost acknowledged pushes: dataset %r is gone from Redis, this "
                  "service acknowledged batches to it (Redis restarted empty?); marked "
                  "lost_acknowledged_data", dataset)
