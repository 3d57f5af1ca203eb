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
ranks that owned those partitions, once per checkpoint). Only rank 0 lists the
store for the kept checkpoints; it publishes them (names and session records, a
document of keep_last entries) with its offsets, and the other ranks read that one
key (:class:`KeptCheckpoint`), so no rank's publish grows with W. With a store
without per-rank objects, rank 0 does it for every partition from the gathered
offsets (:func:`gather_offsets`, session record version 2).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
import torch.distributed as dist

from trainer_client import offsets as ofs
from trainer_client.errors import FencedError
from trainguard.core import record, streams
from trainguard.core.checkpoints import (
    CheckpointStoreAPI,
    CorruptCheckpointError,
    ManifestView,
    RankStateStoreAPI,
    SaveHandleView,
)
from trainguard.core.rank_record import Positions, RankRecord, positions
from trainguard.core.record import RankState, SessionRecord

__all__ = ["KEPT_VERSION", "KeptCheckpoint", "OffsetCommitter", "PositionReader",
           "gather_offsets"]

KEPT_VERSION = 1


@dataclass(frozen=True)
class KeptCheckpoint:
    """A kept checkpoint as rank 0 published it (a ``ManifestView`` of what the
    retention floor needs: name, step, uid and the session record in ``extra``)."""

    name: str
    step: int
    uid: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    pinned: bool = False


def kept_document(kept: Sequence[ManifestView], *, dataset: str, run: str) -> str:
    """The kept checkpoints of this run, as rank 0 publishes them (JSON)."""
    out = []
    for m in kept:
        try:
            rec = record.SessionRecord.of(m)
        except record.RecordError:
            continue
        if rec is not None and rec.run == run and rec.dataset == dataset:
            out.append({"name": m.name, "step": int(m.step), "uid": m.uid,
                        "record": dict(m.extra[record.RECORD_KEY])})
    return json.dumps({"version": KEPT_VERSION, "kept": out}, separators=(",", ":"))


def parse_kept(raw: bytes | str | None) -> list[KeptCheckpoint] | None:
    """The published kept checkpoints; None when absent or not of a version this
    reads (the rank then lists the store itself)."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if doc.get("version") != KEPT_VERSION:
            return None
        return [KeptCheckpoint(str(k["name"]), int(k["step"]), str(k["uid"]),
                               {record.RECORD_KEY: dict(k["record"])}) for k in doc["kept"]]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


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
        lists: bool = True,
    ) -> None:
        """``lists``: this rank lists the store for the kept checkpoints and publishes
        them (rank 0); the others read what it published."""
        self._redis = client
        self._lists = lists
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
            except BaseException as exc:
                if isinstance(exc, FencedError):
                    # Refused by the save's precommit fence check: nothing committed,
                    # and the session's next call says why.
                    self._background_error = exc
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
        kept = self._kept()
        self._reader.forget_all_but({m.name for m in kept})
        mine = sorted(offsets)
        floor = record.retention_floor(
            offsets, kept, dataset=self._dataset, run=self._run,
            positions=None if whole else self._kept_positions(mine))
        committed: dict[Any, Any] = streams.offsets_to_wire(offsets)
        floors: dict[Any, Any] = streams.offsets_to_wire(floor)
        published = kept_document(kept, dataset=self._dataset, run=self._run) \
            if self._lists and not whole else None

        def publish() -> None:
            # A new pipeline per attempt: a failed execute() empties its pipeline, so
            # retrying the same one would publish nothing.
            pipe = r.pipeline(transaction=True)
            # A rank owning no partition (ranks x workers > partitions) has no field to
            # set: redis-py refuses an HSET without one (DataError), which would cost
            # the kept list rank 0 publishes in the same transaction.
            if committed:
                pipe.hset(streams.committed_key(self._dataset, self._run), mapping=committed)
            if whole:
                pipe.delete(streams.floor_key(self._dataset, self._run))
            if floors:
                pipe.hset(streams.floor_key(self._dataset, self._run), mapping=floors)
            if published is not None:
                pipe.set(streams.kept_key(self._dataset, self._run), published)
            if len(pipe):
                pipe.execute()

        self._call(publish)
        self.last_publish_s = time.perf_counter() - t0

    def _kept(self) -> Sequence[ManifestView]:
        """The run's kept checkpoints: listed by rank 0 (and by any rank when rank 0
        published none yet); the others read rank 0's list, one key. A list published
        before rank 0's newest retention names a checkpoint since deleted at worst,
        which only lowers the floor (trims less) until the next commit."""
        if not self._lists:
            raw = self._call(self._redis.get, streams.kept_key(self._dataset, self._run))
            published = parse_kept(raw)
            if published is not None:
                return published
        return self._store.list()

    def _kept_positions(self, mine: list[int]
                        ) -> Callable[[ManifestView, SessionRecord], Mapping[int, str]]:
        def offsets(m: ManifestView, rec: SessionRecord) -> Mapping[int, str]:
            try:
                return self._reader.positions(m, rec, mine).offsets
            except (CorruptCheckpointError, FileNotFoundError):
                # Deleted by retention after rank 0 published it: no floor to keep.
                return {}
        return offsets

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
