"""Phase 3 of the commit protocol: after a manifest committed, acknowledge and publish;
and where each partition stands in a checkpoint.

The manifest is the commit point; what follows only tells Redis about it: XACK every
entry up to the committed offsets (fenced), then publish the committed offsets and the
retention floor (the oldest offsets any kept checkpoint of the run may roll back to)
for monitoring and for the producer's trimming. A crash in between is harmless:
restore acknowledges again. This runs in the store's writer thread (the save
handle's done-callback) unless the checkpoint was blocking; a fencing refusal met
there is kept and raised by the session's next call.

With per-rank state objects (a store with ``supports_rank_state``) every rank does
this for the partitions it reads, and nothing else: it acknowledges them, publishes
their committed offsets and retention floor, and no rank gathers another's offsets
(:class:`PositionReader` reads a kept checkpoint's offsets from the objects of the
ranks that owned those partitions, once per checkpoint). With a store without them,
rank 0 does it for every partition from the gathered offsets (:func:`gather_offsets`,
session record version 2).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
import torch.distributed as dist

from trainer_client import offsets as ofs
from trainer_client.errors import FencedError
from trainguard.core import record, streams
from trainguard.core.checkpoints import (
    CheckpointStoreAPI,
    ManifestView,
    RankStateStoreAPI,
    SaveHandleView,
)
from trainguard.core.rank_record import Positions, RankRecord, positions
from trainguard.core.record import RankState, SessionRecord

__all__ = ["OffsetCommitter", "PositionReader", "gather_offsets"]


class PositionReader:
    """Where partitions stand in checkpoints, from the fewest rank objects: each
    object read is kept per checkpoint (manifests and objects are immutable), and a
    rank's own object of its own commits is known without reading."""

    def __init__(self, store: RankStateStoreAPI | None) -> None:
        self._store = store
        self._objects: dict[str, dict[int, RankRecord]] = {}
        self._lock = threading.Lock()

    def remember(self, name: str, obj: RankRecord) -> None:
        with self._lock:
            self._objects.setdefault(name, {})[obj.rank] = obj

    def known(self, name: str) -> list[RankRecord]:
        """The objects of checkpoint ``name`` read (or remembered) so far, by rank."""
        with self._lock:
            return [o for _, o in sorted(self._objects.get(name, {}).items())]

    def forget_all_but(self, names: set[str]) -> None:
        with self._lock:
            self._objects = {n: o for n, o in self._objects.items() if n in names}

    def object(self, manifest: ManifestView, rank: int) -> RankRecord:
        """Rank ``rank``'s object of ``manifest`` (read once)."""
        with self._lock:
            known = self._objects.get(manifest.name, {}).get(rank)
        if known is not None:
            return known
        if self._store is None:
            raise record.RecordError(f"checkpoint {manifest.name} has per-rank state objects "
                                     "but the store cannot read them: open it with "
                                     "checkpoint_store.CheckpointStore")
        obj = RankRecord.from_wire(self._store.read_rank_state(manifest, rank), rank=rank)
        self.remember(manifest.name, obj)
        return obj

    def positions(self, manifest: ManifestView, rec: SessionRecord,
                  partitions: list[int]) -> Positions:
        with self._lock:
            known = dict(self._objects.get(manifest.name, {}))
        return positions(rec, partitions, lambda r: self.object(manifest, r), known=known)

log = logging.getLogger("trainer_client.session")


class OffsetCommitter:
    """Acknowledges and publishes the offsets of each committed checkpoint of one run."""

    def __init__(
        self,
        client: redis.Redis,
        call: Callable[..., Any],
        store: CheckpointStoreAPI,
        *,
        dataset: str,
        run: str,
        reader: PositionReader | None = None,
    ) -> None:
        self._redis = client
        self._call = call
        self._store = store
        self._dataset = dataset
        self._run = run
        self._lock = threading.Lock()
        self._inflight: list[threading.Event] = []
        self._background_error: BaseException | None = None
        self._reader = reader or PositionReader(None)
        self.last_publish_s: float | None = None
        self.last_committed: tuple[ManifestView, SessionRecord] | None = None
        """The newest checkpoint of this session that committed, with its record."""

    def after(self, handle: SaveHandleView, offsets: Mapping[int, str], generation: int,
              *, blocking: bool, rec: SessionRecord, own: RankRecord | None = None) -> None:
        """Publish ``offsets`` once ``handle``'s manifest committed (nothing if it
        failed). ``blocking``: now, raising a refusal; else from the handle's callback.
        ``own``: this rank's object of the save (its offsets are ``offsets``: only its
        partitions); None: ``offsets`` are every partition's (rank 0, record 2)."""
        done = threading.Event()
        with self._lock:
            self._inflight.append(done)

        def after_commit(h: Any) -> None:
            try:
                manifest = h.wait()
            except BaseException:
                done.set()  # the commit failed: nothing to acknowledge
                return
            if own is not None:
                self._reader.remember(manifest.name, own)
            self.last_committed = (manifest, rec)
            try:
                self.publish(offsets, generation, whole=own is None)
            except BaseException as exc:
                if isinstance(exc, FencedError) or not isinstance(exc, Exception):
                    self._background_error = exc
                else:
                    log.warning("acknowledging offsets after commit failed (restore redoes "
                                "it): %s", exc)
            finally:
                done.set()

        if blocking:
            after_commit(handle)
            self.raise_background()
        else:
            handle.add_done_callback(after_commit)

    def publish(self, offsets: Mapping[int, str], generation: int, *,
                whole: bool = True) -> None:
        """XACK up to ``offsets``, then publish them and their retention floor.
        ``whole``: ``offsets`` are every partition's (the floor hash is rewritten);
        else only this rank's partitions' fields are set."""
        t0 = time.perf_counter()
        r = self._redis
        self._call(ofs.ack_upto, r, self._dataset, self._run, generation, offsets)
        kept = self._store.list()
        self._reader.forget_all_but({m.name for m in kept})
        mine = sorted(offsets)
        floor = record.retention_floor(
            offsets, kept, dataset=self._dataset, run=self._run,
            positions=None if whole else (
                lambda m, rec: self._reader.positions(m, rec, mine).offsets))
        committed: dict[Any, Any] = streams.offsets_to_wire(offsets)
        floors: dict[Any, Any] = streams.offsets_to_wire(floor)

        def publish() -> None:
            # A new pipeline per attempt: a failed execute() empties its pipeline, so
            # retrying the same one would publish nothing.
            pipe = r.pipeline(transaction=True)
            pipe.hset(streams.committed_key(self._dataset, self._run), mapping=committed)
            if whole:
                pipe.delete(streams.floor_key(self._dataset, self._run))
            pipe.hset(streams.floor_key(self._dataset, self._run), mapping=floors)
            pipe.execute()

        self._call(publish)
        self.last_publish_s = time.perf_counter() - t0

    def raise_background(self) -> None:
        """Raise (once) a fencing refusal or fatal error met in the background."""
        exc, self._background_error = self._background_error, None
        if exc is not None:
            raise exc

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every checkpoint handed to :meth:`after` was published."""
        with self._lock:
            events = list(self._inflight)
        for e in events:
            e.wait(timeout_s)
        with self._lock:
            self._inflight = [e for e in self._inflight if not e.is_set()]


def gather_offsets(
    offsets: dict[int, str], batches: dict[int, int], mine: RankState, world_size: int,
    group: Any,
) -> tuple[dict[int, str], dict[int, int], dict[int, RankState]]:
    """Every rank's offsets, batch counts and rank state, merged (a collective): each
    rank holds all partitions' offsets (the restored ones for partitions it does not
    read), and the newest per partition is its owner's."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (offsets, batches, mine.to_wire()), group=group)
    merged: dict[int, str] = {}
    counts: dict[int, int] = {}
    ranks: dict[int, RankState] = {}
    for rank, (offs, bats, state) in enumerate(gathered):
        for p, i in offs.items():
            merged[p] = streams.max_id(merged.get(p), i) or i
        for p, n in bats.items():
            counts[p] = max(counts.get(p, 0), n)
        ranks[rank] = RankState.from_wire(state)
    return merged, counts, ranks
