"""The session's save clock: measures each checkpoint (how long it blocked the loop,
when it became durable), writes the timing record into the next manifests, and
answers ``should_checkpoint`` from the interval advisor.

Kept apart from ``session.py`` so that the session only calls it at four points:
restore, rollback, checkpoint (``extra`` before the save, ``saved`` after) and
``should_checkpoint``. Format: :mod:`trainguard.core.timing`; formula:
:mod:`trainguard.core.interval`.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from trainguard.core.checkpoints import ManifestView, SaveHandleView
from trainguard.core.interval import Advice, IntervalPolicy, advise
from trainguard.core.timing import (
    Event,
    SaveTime,
    TimingError,
    TimingRecord,
    Totals,
    last_saves,
)

__all__ = ["SaveClock"]


class SaveClock:
    """One process's view of its run's save timing (thread-safe: a save's durable
    time is set from the store's writer thread)."""

    def __init__(self, policy: IntervalPolicy | None = None) -> None:
        self.policy = policy or IntervalPolicy()
        self._lock = threading.Lock()
        self._saves: tuple[SaveTime, ...] = ()
        self._events: list[Event] = []
        self._carried = Totals()
        self._started = time.monotonic()
        self._last_save_end: float | None = None
        self._last_save_step: int | None = None
        self._last_step: int | None = None
        self._last_interval: float | None = None
        self._since = time.monotonic()  # when the loop last resumed after a save or restore

    def restored(self, manifest: ManifestView | None, generation: int | None) -> None:
        """A restore loaded ``manifest`` (None: a fresh start): carry its totals and
        measured saves over, and note a restart when it resumes a checkpoint."""
        rec = _timing(manifest)
        now = time.monotonic()
        with self._lock:
            self._started = self._since = now
            self._last_save_end = None
            if manifest is None:
                return
            totals = rec.totals if rec else Totals()
            self._carried = Totals(totals.restarts + 1, totals.rollbacks, totals.trained_s)
            self._saves = rec.saves if rec else ()
            self._events.append(Event("restore", int(manifest.step), generation, time.time(),
                                      None))

    def count_failures(self, failures: int) -> None:
        """The run's failed attempts as Redis recorded them (those that died before
        their first checkpoint too): the advisor's failure count is at least that."""
        with self._lock:
            c = self._carried
            self._carried = Totals(max(c.restarts, failures), c.rollbacks, c.trained_s)

    def rolled_back(self, to_step: int, generation: int | None) -> None:
        with self._lock:
            self._events.append(Event("rollback", to_step, generation, time.time(),
                                      self._last_step))
            c = self._carried
            self._carried = Totals(c.restarts, c.rollbacks + 1, c.trained_s)
            self._since = time.monotonic()

    def extra(self, step: int) -> dict[str, Any]:
        """The timing record of a save of ``step`` starting now (manifest ``extra``)."""
        now = time.monotonic()
        with self._lock:
            c = self._carried
            rec = TimingRecord(
                saves=self._saves, events=tuple(self._events),
                interval_s=None if self._last_save_end is None else now - self._last_save_end,
                interval_steps=(None if self._last_save_step is None
                                else step - self._last_save_step),
                totals=Totals(c.restarts, c.rollbacks, c.trained_s + (now - self._started)),
            )
            self._events.clear()
            if rec.interval_s is not None:
                self._last_interval = rec.interval_s
        return rec.to_extra()

    def saved(self, handle: SaveHandleView, step: int, started: float) -> None:
        """``store.save`` of ``step`` (begun at monotonic ``started``) returned now."""
        end = time.monotonic()
        entry = SaveTime(step, None, end - started, None)
        with self._lock:
            self._saves = last_saves(self._saves, entry)
            self._last_save_end = self._since = end
            self._last_save_step = self._last_step = step

        def durable(h: Any) -> None:
            done = time.monotonic()
            try:
                name = h.wait().name
            except BaseException:
                return  # failed: no durable time, and no manifest to name
            with self._lock:
                self._saves = tuple(
                    SaveTime(s.step, name, s.blocked_s, done - started) if s is entry else s
                    for s in self._saves)

        handle.add_done_callback(durable)

    def advice(self) -> Advice | None:
        """The recommendation now; None before any save was measured."""
        with self._lock:
            saves = self._saves
            c = self._carried
            observed = c.trained_s + (time.monotonic() - self._started)
            current = self._last_interval
        if not saves:
            return None
        blocked = statistics.median(s.blocked_s for s in saves)
        durables = [s.durable_s for s in saves if s.durable_s is not None]
        durable = statistics.median(durables) if durables else blocked
        return advise(blocked_s=blocked, durable_s=durable, observed_s=observed,
                      failures=c.restarts, current_s=current, policy=self.policy)

    def elapsed_s(self, step: int) -> float:
        """Seconds the loop has trained since the last save (or restore), now that it
        reached ``step``."""
        with self._lock:
            self._last_step = step
            return time.monotonic() - self._since

    def should_checkpoint(self, step: int) -> bool:
        """True when the loop has run at least the recommended interval since the last
        save (or restore). Before any save is measured: after ``min_interval_s``, so
        the first save measures the cost."""
        elapsed = self.elapsed_s(step)
        advice = self.advice()
        due = self.policy.min_interval_s if advice is None else advice.recommended_s
        return elapsed >= due


def _timing(manifest: ManifestView | None) -> TimingRecord | None:
    if manifest is None:
        return None
    try:
        return TimingRecord.from_extra(manifest.extra)
    except TimingError:
        return None  # an unreadable timing record costs the history, never the restore
