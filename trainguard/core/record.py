"""The session record: what a ``TrainingSession`` writes into each checkpoint manifest,
and the one order in which checkpoints are restored.

A manifest's ``extra`` carries it under two keys (the user's own ``extra`` keys sit
beside them)::

    extra["trainguard"]        version 4 (3: skipped batches in the manifest, below;
                               2: with offsets, batches and ranks, below;
                               1: without seed and ranks)
        version      4
        dataset      dataset name               run          the run (= consumer group)
        partitions   partition count            world_size   ranks that wrote it
        num_workers  DataLoader workers per rank of the pass it was taken in
        generation   fencing generation of the writer
        commit       the writer's commit counter
        seed         the run seed (DataLoader generators derive from it)
      version 2 only (from version 3 on, each rank writes its part of these into its
      own state object: :mod:`trainguard.core.rank_record`):
        offsets      {"<partition>": "<last consumed stream ID>"} for every partition
                     ("0-0": nothing consumed yet)
        batches      {"<partition>": <batches consumed from it>} (deterministic mode)
        ranks        {"<rank>": {"rng": {...}, "epoch": e, "epoch_batches": n}}: each
                     rank's random states when the checkpoint was taken (torch CPU,
                     CUDA per device, NumPy, Python ``random``; see ``RankState``) and
                     the epoch it was in with the batches it consumed there
    extra["skipped_batches"]   versions 1 to 3 only: IDs of every batch consumed but
                               never trained (written only by runs that skip batches:
                               ``GuardedTraining``, the restart-loop breaker); from
                               version 4 on each rank's object holds its own
                               (:func:`trainguard.core.rank_record.checkpoint_skipped`)

:class:`SessionRecord` is that document as one frozen type, and
:meth:`SessionRecord.from_extra` its only parser. The test
``test_fresh_run_reads_everything_and_final_checkpoint_acks_all`` pins the exact
document.

Restore order (:func:`trainguard.core.newest.restore_order`): the newest by ``(generation, commit, commit
time)``. A rollback's lineage beats the higher steps it abandoned (a rollback keeps
counting commits up), and a newer generation beats a zombie's late commit. A
checkpoint without a session record sorts by its commit time alone, so for plain
``CheckpointStore`` users this is "the newest committed". Every walker of "the
checkpoint a restart resumes from" sorts by it: the session, both stores, the admin
API and the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.core import streams
from trainguard.core.checkpoints import ManifestView
from trainguard.core.errors import TrainguardError

__all__ = [
    "RECORD_KEY",
    "PER_RANK_VERSION",
    "RECORD_VERSION",
    "SKIPPED_KEY",
    "SKIPS_PER_RANK_VERSION",
    "RankState",
    "RecordError",
    "SessionRecord",
    "retention_floor",
]

RECORD_KEY = "trainguard"
SKIPPED_KEY = "skipped_batches"
RECORD_VERSION = 4
PER_RANK_VERSION = 3
"""From this version on, offsets, batches and rank states are in per-rank objects."""
SKIPS_PER_RANK_VERSION = 4
"""From this version on, skipped batches are in per-rank objects too (not the manifest)."""



class RecordError(TrainguardError, ValueError):
    """A manifest's session record is malformed, or newer than this trainguard reads."""


@dataclass(frozen=True)
class RankState:
    """What one rank needs to resume bitwise: its random states and epoch position.

    ``rng`` holds each generator's state as plain JSON (byte states base64-encoded):
    ``{"torch": b64, "cuda": [b64 per device], "numpy": [kind, b64 of uint32 keys,
    pos, has_gauss, cached_gaussian], "python": [version, b64 of uint32 words,
    gauss_next]}``; missing generators are left as they are on restore. The
    foundation keeps it opaque: ``trainer_client`` captures and sets it."""

    rng: Mapping[str, Any] = field(default_factory=dict)
    epoch: int = 0
    epoch_batches: int = 0

    def to_wire(self) -> dict[str, Any]:
        return {"rng": dict(self.rng), "epoch": self.epoch, "epoch_batches": self.epoch_batches}

    @classmethod
    def from_wire(cls, doc: Mapping[str, Any]) -> RankState:
        rng = doc.get("rng") or {}
        if not isinstance(rng, Mapping):
            raise TypeError(f"rng is a {type(rng).__name__}, expected an object")
        return cls(rng=dict(rng), epoch=int(doc.get("epoch", 0)),
                   epoch_batches=int(doc.get("epoch_batches", 0)))


@dataclass(frozen=True)
class SessionRecord:
    """One checkpoint's session record; see the module docstring for each field."""

    dataset: str
    run: str
    partitions: int
    generation: int
    commit: int
    world_size: int
    num_workers: int
    offsets: Mapping[int, str] = field(default_factory=dict)
    batches: Mapping[int, int] = field(default_factory=dict)
    skipped: tuple[str, ...] | None = None
    """Batches consumed but never trained (before version 4; from then on in the rank
    objects); None: the manifest lists none."""
    seed: int | None = None
    """The run seed; None in version 1 records (the session then uses its own)."""
    ranks: Mapping[int, RankState] = field(default_factory=dict)
    """Per rank, its random states and epoch position (empty in version 1 records)."""
    version: int = RECORD_VERSION

    def to_extra(self) -> dict[str, Any]:
        """The record as manifest ``extra`` keys (JSON-ready)."""
        doc: dict[str, Any] = {
            RECORD_KEY: {
                "version": self.version,
                "dataset": self.dataset,
                "run": self.run,
                "partitions": self.partitions,
                "generation": self.generation,
                "commit": self.commit,
                "world_size": self.world_size,
                "num_workers": self.num_workers,
                "offsets": streams.offsets_to_wire(self.offsets),
                "batches": {str(p): int(n) for p, n in sorted(self.batches.items())},
            }
        }
        if self.version >= PER_RANK_VERSION:
            del doc[RECORD_KEY]["offsets"], doc[RECORD_KEY]["batches"]
            doc[RECORD_KEY]["seed"] = self.seed
        elif self.version >= 2:
            doc[RECORD_KEY]["seed"] = self.seed
            doc[RECORD_KEY]["ranks"] = {str(r): s.to_wire() for r, s in sorted(self.ranks.items())}
        if self.skipped is not None:
            if self.version >= SKIPS_PER_RANK_VERSION:
                raise ValueError(f"a version {self.version} session record keeps no skipped "
                                 "batches: each rank's object holds its own")
            doc[SKIPPED_KEY] = list(self.skipped)
        return doc

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> SessionRecord | None:
        """The record in a manifest's ``extra``; None when it has none (not written by
        a session). Raises :class:`RecordError` when it is malformed or of a newer
        version."""
        doc = (extra or {}).get(RECORD_KEY)
        if not doc:
            return None
        if not isinstance(doc, Mapping):
            raise RecordError(f"the session record is a {type(doc).__name__}, expected an object")
        try:
            version = int(doc.get("version", 0))
            if version > RECORD_VERSION:
                raise RecordError(
                    f"the session record has version {version}, this trainguard reads up to "
                    f"{RECORD_VERSION}: upgrade trainguard"
                )
            skipped = (extra or {}).get(SKIPPED_KEY)
            # Fields a reader needs to order checkpoints default to "oldest"; the
            # identity (dataset, run, partitions) defaults to values that no run has,
            # so check_record refuses such a record with a clear message.
            return cls(
                dataset=_name("dataset", doc.get("dataset", "")),
                run=_name("run", doc.get("run", "")),
                partitions=int(doc.get("partitions", -1)),
                generation=int(doc.get("generation", 0)),
                commit=int(doc.get("commit", 0)),
                world_size=int(doc.get("world_size", 1)),
                num_workers=int(doc.get("num_workers", 0)),
                offsets=streams.offsets_from_wire(doc.get("offsets") or {}),
                batches={int(p): int(n) for p, n in (doc.get("batches") or {}).items()},
                skipped=None if skipped is None else tuple(str(b) for b in skipped),
                seed=None if doc.get("seed") is None else int(doc["seed"]),
                ranks={int(r): RankState.from_wire(v) for r, v in (doc.get("ranks") or {}).items()},
                version=version,
            )
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, RecordError):
                raise
            raise RecordError(
                f"the session record is malformed ({type(exc).__name__}: {exc}); expected "
                "the document TrainingSession.checkpoint writes"
            ) from exc

    @classmethod
    def of(cls, manifest: ManifestView) -> SessionRecord | None:
        """:meth:`from_extra` of ``manifest.extra``."""
        return cls.from_extra(manifest.extra)


def _name(kind: str, value: Any) -> str:
    """A dataset or run name from a manifest, checked as every name is (a forged one
    could carry terminal escapes into ``trainguard runs ls``); "" means none."""
    text = str(value)
    return streams.check_name(kind, text) if text else text


def retention_floor(
    newest: Mapping[int, str], kept: Sequence[ManifestView], *, dataset: str, run: str,
    positions: Callable[[ManifestView, SessionRecord], Mapping[int, str]] | None = None,
) -> dict[int, str]:
    """Per partition of ``newest``, the smallest offset over ``newest`` and the kept
    checkpoints of this run: the producer may trim below it, never at or above.
    ``positions(manifest, record)``: the offsets of ``newest``'s partitions in a kept
    checkpoint (default: the record's own, which a version 3 record does not carry)."""
    out = dict(newest)
    for m in kept:
        try:
            record = SessionRecord.of(m)
        except RecordError:
            continue
        if record is None or record.run != run or record.dataset != dataset:
            continue
        offsets = record.offsets if positions is None else positions(m, record)
        for p, i in offsets.items():
            if p in out:
                out[p] = streams.min_id(out[p], i) or i
    return out
