"""The rank record: what one rank of a session writes as its own state object, and
where a restore finds the position of each partition.

From session record version 3 on, a checkpoint's manifest keeps only the run-wide
record (``extra["trainguard"]``: identity, generation, commit, layout, seed); each
rank writes the rest into its own state object beside its shards (the store's
``save(rank_state=...)``, indexed by digest in the manifest)::

    version      1
    rank         the rank that wrote it     world_size   ranks of the save
    num_workers  the DataLoader workers of the layout its partitions were counted in
    offsets      {"<partition>": "<last consumed stream ID>"} for every partition the
                 rank reads in that layout (``streams.rank_partitions``)
    batches      {"<partition>": <batches consumed from it>}
    rng, epoch, epoch_batches   its random states and epoch position (``RankState``)
    skipped      (version 2, only when the run skips batches) the batch IDs this rank
                 consumed but never trained, so far in the run (spike rollbacks and
                 the restart-loop breaker); from session record version 4 on they are
                 here and not in the manifest (:func:`checkpoint_skipped`)

The partitions of all ranks' objects together are every partition once, so no rank
needs another's offsets to commit. :func:`positions` answers "where does each of these
partitions stand in this checkpoint?" by reading only the objects of the ranks that
owned them (:func:`streams.partition_owner` of the checkpoint's layout): on the same
world size and worker count one object, a rank's own.

Skipped batches travel the same way: a rank restored on the same layout carries on
its own object's list; after a world change, each rank carries the skips of the
objects it read that name one of its new partitions (:func:`carried_skips`), so the
ranks' lists together are still the run's, and no rank reads every object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.core import streams
from trainguard.core.checkpoints import ManifestView, RankStateStoreAPI
from trainguard.core.record import SKIPS_PER_RANK_VERSION, RankState, RecordError, SessionRecord

__all__ = ["RANK_RECORD_VERSION", "Positions", "RankRecord", "carried_skips",
           "checkpoint_offsets", "checkpoint_positions", "checkpoint_skipped", "positions"]

RANK_RECORD_VERSION = 2
"""2: with ``skipped``; 1 (no skipped batches) still reads."""


@dataclass(frozen=True)
class RankRecord:
    """One rank's state object of a checkpoint; see the module docstring."""

    rank: int
    world_size: int
    num_workers: int
    offsets: Mapping[int, str] = field(default_factory=dict)
    batches: Mapping[int, int] = field(default_factory=dict)
    state: RankState = field(default_factory=RankState)
    skipped: tuple[str, ...] | None = None
    """This rank's batches consumed but never trained; None: it does not skip."""
    version: int = RANK_RECORD_VERSION

    def to_wire(self) -> dict[str, Any]:
        doc = {
            "version": self.version, "rank": self.rank, "world_size": self.world_size,
            "num_workers": self.num_workers, "offsets": streams.offsets_to_wire(self.offsets),
            "batches": {str(p): int(n) for p, n in sorted(self.batches.items())},
            **self.state.to_wire(),
        }
        if self.skipped is not None:
            doc["skipped"] = list(self.skipped)
        return doc

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any] | None, *, rank: int) -> RankRecord:
        """Parse rank ``rank``'s object; RecordError when it is missing, malformed or
        of a newer version."""
        if not isinstance(doc, Mapping):
            raise RecordError(f"checkpoint has no state object of rank {rank} (found "
                              f"{type(doc).__name__}): expected one written by a session")
        try:
            version = int(doc.get("version", 0))
            if version > RANK_RECORD_VERSION:
                raise RecordError(f"the state object of rank {rank} has version {version}, "
                                  f"this trainguard reads up to {RANK_RECORD_VERSION}: "
                                  "upgrade trainguard")
            skipped = doc.get("skipped")
            if skipped is not None and not isinstance(skipped, list):
                raise TypeError(f"skipped is a {type(skipped).__name__}, expected a list")
            out = cls(
                rank=int(doc["rank"]), world_size=int(doc["world_size"]),
                num_workers=int(doc["num_workers"]),
                offsets=streams.offsets_from_wire(doc.get("offsets") or {}),
                batches={int(p): int(n) for p, n in (doc.get("batches") or {}).items()},
                state=RankState.from_wire(doc),
                skipped=None if skipped is None else tuple(str(b) for b in skipped),
                version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RecordError):
                raise
            raise RecordError(f"the state object of rank {rank} is malformed "
                              f"({type(exc).__name__}: {exc}); expected the document "
                              "TrainingSession.checkpoint writes") from exc
        if out.rank != rank:
            raise RecordError(f"the state object read as rank {rank}'s says rank {out.rank}")
        return out


@dataclass(frozen=True)
class Positions:
    """Where some partitions stand in one checkpoint, and which objects told it."""

    offsets: dict[int, str]
    batches: dict[int, int]
    read: dict[int, RankRecord]
    """The rank objects read, by rank (empty for a version 2 record)."""


def positions(rec: SessionRecord, partitions: Iterable[int],
              read: Callable[[int], RankRecord], *,
              known: Mapping[int, RankRecord] | None = None) -> Positions:
    """The offsets and batch counts of ``partitions`` in the checkpoint of ``rec``.

    A version 2 record carries them all; from version 3 on, each is read from the
    object of the rank that owned it (``read(rank)``, once per rank, ``known``
    ones not at all). O(len(partitions) + objects read)."""
    wanted = list(partitions)
    if rec.version < 3:
        return Positions({p: rec.offsets.get(p, streams.ZERO_ID) for p in wanted},
                         {p: rec.batches.get(p, 0) for p in wanted}, {})
    objects: dict[int, RankRecord] = dict(known or {})
    read_now: dict[int, RankRecord] = {}
    offsets: dict[int, str] = {}
    batches: dict[int, int] = {}
    for p in wanted:
        owner = streams.partition_owner(p, partitions=rec.partitions,
                                        world_size=rec.world_size, num_workers=rec.num_workers)
        obj = objects.get(owner)
        if obj is None:
            obj = objects[owner] = read_now[owner] = read(owner)
        if p not in obj.offsets:
            raise RecordError(
                f"the state object of rank {owner} holds no offset of partition {p}, which "
                f"that rank reads in the checkpoint's layout (world_size={rec.world_size}, "
                f"num_workers={rec.num_workers}): the checkpoint is inconsistent; restore "
                "an earlier one"
            )
        offsets[p] = obj.offsets[p]
        batches[p] = obj.batches.get(p, 0)
    return Positions(offsets, batches, read_now)


def checkpoint_positions(store: RankStateStoreAPI, manifest: ManifestView) -> Positions:
    """Every partition's offset and batch count in checkpoint ``manifest`` of ``store``
    (a ``RankStateStoreAPI``): the record's own (version 2), or from all its rank
    objects (version 3: one read per rank, for tools, tests and the admin API; a rank's
    commit or restore reads only what :func:`positions` needs). Empty without a
    session record."""
    rec = SessionRecord.of(manifest)
    if rec is None:
        return Positions({}, {}, {})
    if rec.version < 3:
        return Positions(dict(rec.offsets), dict(rec.batches), {})
    return positions(rec, range(rec.partitions), lambda rank: RankRecord.from_wire(
        store.read_rank_state(manifest, rank), rank=rank))


def checkpoint_offsets(store: RankStateStoreAPI, manifest: ManifestView) -> dict[int, str]:
    """Every partition's offset in checkpoint ``manifest`` (see
    :func:`checkpoint_positions`)."""
    return checkpoint_positions(store, manifest).offsets


def _partitions_of(batch: str) -> set[int] | None:
    """The partitions a batch ID (``"<p>:<first>..<last>"`` joined by ``;``) names;
    None for an ID of another shape (a caller's own ``skipped`` entry)."""
    try:
        return {int(part.partition(":")[0]) for part in batch.split(";")}
    except ValueError:
        return None


def carried_skips(objects: Iterable[RankRecord], partitions: Iterable[int]) -> tuple[str, ...] | None:
    """The skipped batches a rank carries on after a restore that read ``objects``
    (its own on the same layout; the owners' of its new ``partitions`` after a world
    change): every skip of those objects that names one of ``partitions``, and every
    one not shaped as a batch ID (no partition to place it by), in object order, once.
    None when no object skips."""
    mine = set(partitions)
    out: dict[str, None] = {}
    seen = False
    for obj in objects:
        if obj.skipped is None:
            continue
        seen = True
        for b in obj.skipped:
            named = _partitions_of(b)
            if named is None or named & mine:
                out[b] = None
    return tuple(out) if seen else None


def checkpoint_skipped(store: RankStateStoreAPI | None, manifest: ManifestView,
                       rec: SessionRecord) -> tuple[str, ...] | None:
    """The run's skipped batches in checkpoint ``manifest``: the manifest's own (session
    record before version 4), else every rank object's, in rank order, once (one read
    per rank: for the run history and tools, never a commit or restore). None when no
    rank skips."""
    if rec.version < SKIPS_PER_RANK_VERSION:
        return rec.skipped
    if store is None:
        raise RecordError(f"checkpoint {manifest.name} keeps its skipped batches in per-rank "
                          "state objects but the store cannot read them: open it with "
                          "checkpoint_store.CheckpointStore")
    out: dict[str, None] = {}
    seen = False
    for rank in range(rec.world_size):
        obj = RankRecord.from_wire(store.read_rank_state(manifest, rank), rank=rank)
        if obj.skipped is not None:
            seen = True
            out.update(dict.fromkeys(obj.skipped))
    return tuple(out) if seen else None
