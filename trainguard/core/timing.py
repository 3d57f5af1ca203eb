"""The timing record: what a ``TrainingSession`` adds to each manifest about how its
saves went and what happened to the run, so that run history and the interval advisor
need no database of their own.

A manifest's ``extra`` carries it beside the session record::

    extra["trainguard_timing"]   version 1
        version    1
        saves      the last SAVES_KEPT saves of this process measured before this one,
                   oldest first: {"step", "name" (manifest), "blocked_s" (seconds the
                   loop was stopped), "durable_s" (seconds from the start of the save
                   until its manifest committed; null when it had not yet)}
        events     restores and rollbacks since the previous save of this process:
                   {"kind": "restore"|"rollback", "to_step", "generation", "at" (unix s),
                    "last_step" (the step the loop had reached; null after a crash)}
        interval   {"seconds", "steps"} since the previous save (null for the first)
        totals     {"restarts", "rollbacks", "trained_s"} of the run so far, carried
                   over restores (trained_s: seconds of training processes up to this
                   save, counted from each process's restore)

A save cannot carry its own timing (its manifest is written while it runs), so a
checkpoint's figures are read from the manifests that follow it. Each record repeats
the last few, so a retention that deletes manifests loses little.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast, get_args

from trainguard.core.errors import TrainguardError

__all__ = ["SAVES_KEPT", "TIMING_KEY", "TIMING_VERSION", "Event", "EventKind", "SaveTime", "TimingError",
           "TimingRecord", "Totals"]

TIMING_KEY = "trainguard_timing"
TIMING_VERSION = 1
SAVES_KEPT = 8


class TimingError(TrainguardError, ValueError):
    """A manifest's timing record is malformed, or newer than this trainguard reads."""


@dataclass(frozen=True)
class SaveTime:
    step: int
    name: str | None
    blocked_s: float
    durable_s: float | None


EventKind = Literal["restore", "rollback"]
"""What moved a run's position back: a restore at a restart, or a rollback."""


@dataclass(frozen=True)
class Event:
    kind: EventKind
    to_step: int
    generation: int | None
    at: float
    last_step: int | None


@dataclass(frozen=True)
class Totals:
    restarts: int = 0
    rollbacks: int = 0
    trained_s: float = 0.0


@dataclass(frozen=True)
class TimingRecord:
    saves: tuple[SaveTime, ...] = ()
    events: tuple[Event, ...] = ()
    interval_s: float | None = None
    interval_steps: int | None = None
    totals: Totals = field(default_factory=Totals)
    version: int = TIMING_VERSION

    def to_extra(self) -> dict[str, Any]:
        return {TIMING_KEY: {
            "version": self.version,
            "saves": [asdict(s) for s in self.saves],
            "events": [asdict(e) for e in self.events],
            "interval": {"seconds": self.interval_s, "steps": self.interval_steps},
            "totals": asdict(self.totals),
        }}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> TimingRecord | None:
        """The record in ``extra``; None when it has none (an older writer)."""
        doc = (extra or {}).get(TIMING_KEY)
        if not doc:
            return None
        version = doc.get("version", 0) if isinstance(doc, Mapping) else 0
        if isinstance(version, int) and version > TIMING_VERSION:
            raise TimingError(
                f"the timing record has version {version}, this trainguard reads up to "
                f"{TIMING_VERSION}: upgrade trainguard")
        try:
            return _parse(doc)
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise TimingError(
                f"the timing record is malformed ({type(exc).__name__}: {exc}); expected "
                "the document TrainingSession.checkpoint writes") from exc


def _parse(doc: Mapping[str, Any]) -> TimingRecord:
    interval = doc.get("interval") or {}
    totals = doc.get("totals") or {}
    return TimingRecord(
        saves=tuple(_save(s) for s in doc.get("saves") or ()),
        events=tuple(_event(e) for e in doc.get("events") or ()),
        interval_s=_opt_float(interval.get("seconds")),
        interval_steps=_opt_int(interval.get("steps")),
        totals=Totals(int(totals.get("restarts", 0)), int(totals.get("rollbacks", 0)),
                      float(totals.get("trained_s", 0.0))),
        version=int(doc.get("version", 0)),
    )


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _save(doc: Mapping[str, Any]) -> SaveTime:
    name = doc.get("name")
    return SaveTime(int(doc["step"]), None if name is None else str(name),
                    float(doc["blocked_s"]), _opt_float(doc.get("durable_s")))


def _event(doc: Mapping[str, Any]) -> Event:
    kind = str(doc["kind"])
    if kind not in get_args(EventKind):
        raise ValueError(f"event kind {kind!r} is unknown: expected restore or rollback")
    return Event(cast(EventKind, kind), int(doc["to_step"]), _opt_int(doc.get("generation")),
                 float(doc["at"]), _opt_int(doc.get("last_step")))


def last_saves(saves: Sequence[SaveTime], new: SaveTime) -> tuple[SaveTime, ...]:
    """``saves`` with ``new`` appended, the oldest dropped past SAVES_KEPT."""
    return (*saves, new)[-SAVES_KEPT:]
