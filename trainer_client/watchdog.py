"""The watchdog: notices a rank that makes no progress, from the step times it measured.

A :class:`TrainingSession` starts one per process. Each step (one batch handed to the
loop by ``session.batches``) is a heartbeat; the watchdog learns the step-time
distribution and fires when no step ended for ``k x p99`` (at least ``floor_s``, at
most ``ceiling_s``). Phases that legitimately take longer have budgets of their own:
start-up (session made → restore, and the first ``min_steps`` steps, which compile,
warm caches and start DataLoader workers), restore, checkpoint (the blocking part of a
save, and waiting for in-flight ones). Outside the loop (after ``batches`` ended) it
does not watch; ``session.watch("eval", limit_s=...)`` gives other work between steps
a budget of its own.

A stopped peer is noticed sooner than that (``peer_silence_s``): the checkers (ranks 0
and 1, so that one of them stopped does not blind the job) read the peers' heartbeats
once a beat while their own phase has made no progress for that long, and fire when
a peer of this attempt, in a watched phase, beat nothing for that long while the
others beat on (its beat older than the freshest by that much, and still unchanged a
confirmation window later). The heartbeat runs on a thread of its own, so a live rank
beats while it waits in a collective, runs a slow step or saves; a rank that beats
nothing is stopped (SIGSTOP, a wedged host) however slow the steps of a loaded machine
made the step budget. A peer of this host that is gone is no hang (its agent restarts
the group).

On firing it dumps every thread's stack (``sys._current_frames``) into a report
(written by the session to Redis, see :mod:`trainguard.core.incidents`), kills
peers of this host whose heartbeat stopped (a process stopped by a signal or wedged
in user space: torchrun's agent would otherwise wait out its 30 s shutdown for them)
and exits with :data:`~trainguard.core.exit_codes.EXIT_HUNG` (86), so the torchrun
agent restarts the group.

The peers of a hung or dead rank must give up in seconds, not torch's 30 minutes:
:func:`init_process_group` starts ``torch.distributed`` with the start-up budget as
collective timeout, and once steps are measured the session tightens the default
group's timeout to the same figure as the watchdog's (per phase).

Configuration: ``TrainingSession(watchdog=WatchdogConfig(...))``, ``watchdog=False``
to disable, or ``$TRAINGUARD_WATCHDOG``: ``off``, or ``key=value,...`` of the fields
below (``k=5,floor_s=30,checkpoint_s=1800``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

from trainguard.core import lists, settings
from trainguard.core.exit_codes import EXIT_HUNG
from trainguard.core.incidents import HANG
from trainguard.core.process import pid_alive

__all__ = ["WATCHDOG_ENV", "Watchdog", "WatchdogConfig", "init_process_group", "silent_peers",
           "thread_stacks"]

log = logging.getLogger(__name__)

HOST = socket.gethostname()

WATCHDOG_ENV = settings.WATCHDOG_ENV
PHASES = ("startup", "restore", "train", "checkpoint", "idle")


@dataclass(frozen=True)
class WatchdogConfig:
    enabled: bool = True
    k: float = 10.0
    """A step is overdue after ``k`` times the p99 of the measured step times."""
    floor_s: float = 60.0
    """The step budget is never below this (noise of short steps, a slow batch)."""
    ceiling_s: float = 1800.0
    """Nor above this; also the ceiling of the collective timeout."""
    startup_s: float = 900.0
    """Budget from the session's start to its restore, and for the first steps."""
    restore_s: float = 900.0
    checkpoint_s: float = 900.0
    min_steps: int = 10
    """Steps measured before the step budget replaces the start-up budget."""
    heartbeat_s: float = 1.0
    """How often each rank writes its heartbeat (how peers tell a stopped rank)."""
    kill_stalled_peers: bool = True
    """On firing, SIGKILL the ranks of this host whose heartbeat stopped."""
    peer_silence_s: float = 10.0
    """A checker fires when a peer beat nothing for this long (0: only the budgets)."""

    def __post_init__(self) -> None:
        if not self.k > 1.0 or not 0 < self.floor_s <= self.ceiling_s:
            raise ValueError(f"WatchdogConfig needs k > 1 and 0 < floor_s <= ceiling_s; got "
                             f"k={self.k}, floor_s={self.floor_s}, ceiling_s={self.ceiling_s}")
        for name in ("startup_s", "restore_s", "checkpoint_s", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WatchdogConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.peer_silence_s < 0:
            raise ValueError(f"WatchdogConfig.peer_silence_s must be >= 0 (0: off), got "
                             f"{self.peer_silence_s}")
        if self.min_steps < 1:
            raise ValueError(f"WatchdogConfig.min_steps must be >= 1, got {self.min_steps}")

    @classmethod
    def from_env(cls, raw: str | None = None) -> WatchdogConfig:
        """``$TRAINGUARD_WATCHDOG`` (or ``raw``): unset → the defaults under an
        elastic agent (``$TORCHELASTIC_RUN_ID`` set), off elsewhere; ``on`` → the
        defaults anywhere; ``off`` → disabled; else ``key=value,...`` of this class's
        fields.

        Unset means off outside an agent because the watchdog's remedy is an exit for
        the agent to restart: in a plain process (a notebook, a test run, a script
        that leaves a session open while it does other work) nothing would restart
        it, and the exit would only end the host process."""
        text = (settings.watchdog() if raw is None else raw).strip()
        if not text:
            return cls(enabled=bool(os.environ.get("TORCHELASTIC_RUN_ID")))
        if text.lower() in ("on", "1", "true"):
            return cls()
        if text.lower() in ("off", "0", "false"):
            return cls(enabled=False)
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        expected = f"key=value of {sorted(types)} (or 'off')"
        for key, value in lists.pairs(text, what=f"{WATCHDOG_ENV} item",
                                      expected=expected).items():
            if key not in types:
                raise ValueError(f"{WATCHDOG_ENV}={text!r}: {f'{key}={value}'!r} is not "
                                 f"{expected}")
            kind = types[key]
            try:
                values[key] = (value.lower() in ("1", "true", "on") if kind == "bool"
                               else int(value) if kind == "int" else float(value))
            except ValueError as exc:
                raise ValueError(f"{WATCHDOG_ENV}: {key}={value!r} is not a {kind}") from exc
        return replace(cls(), **values)

    def step_limit_s(self, p99_s: float | None) -> float:
        """The no-progress budget of a training step for this p99 (None: start-up)."""
        if p99_s is None:
            return self.startup_s
        return min(max(self.k * p99_s, self.floor_s), self.ceiling_s)

    def confirm_s(self) -> float:
        """How long a peer's silence must last on our own clock as well (a peer whose
        beat only looks old, e.g. read just after Redis came back, beats again in it)."""
        return max(1.0, 5 * self.heartbeat_s)

    def phase_limit_s(self, phase: str, p99_s: float | None) -> float | None:
        """The budget of ``phase``; None: not watched."""
        return {"startup": self.startup_s, "restore": self.restore_s,
                "checkpoint": self.checkpoint_s, "train": self.step_limit_s(p99_s),
                }.get(phase)


def init_process_group(backend: str | None = None, *, config: WatchdogConfig | None = None,
                       **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` with a collective timeout the watchdog
    chose (its start-up budget, capped by its ceiling) instead of torch's 30 minutes;
    :class:`~trainer_client.TrainingSession` tightens it to the measured step budget
    once it has one. ``timeout=`` in ``kwargs`` wins. Call it instead of
    ``dist.init_process_group`` in the training script.

    Under ``torchrun --rdzv-backend=trainguard`` (``$TRAINGUARD_RDZV_WORKER`` set) and
    with neither ``store=`` nor ``init_method=`` given, the group's store is the
    rendezvous' Redis, under this round's prefix (:mod:`trainguard.elastic.worker`);
    elsewhere torch's default (``env://``)."""
    import torch.distributed as dist

    cfg = config or WatchdogConfig.from_env()
    kwargs.setdefault("timeout", timedelta(seconds=min(cfg.startup_s, cfg.ceiling_s)))
    info = None
    if kwargs.get("store") is None and kwargs.get("init_method") is None \
            and settings.rdzv_worker():
        # A worker of the trainguard rendezvous: the group's store is the round's in
        # Redis, not a TCPStore served by this round's rank-0 worker (a node that
        # can die). Imported only here: no other worker needs the rendezvous.
        from trainguard.elastic.worker import WorkerRendezvous, process_group_store

        info = WorkerRendezvous.of_this_worker()
    if info is not None:
        kwargs["store"] = process_group_store(info, timeout=kwargs["timeout"])
        kwargs.setdefault("rank", int(os.environ["RANK"]))
        kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
        log.info("process group store: the trainguard rendezvous' Redis, prefix %s",
                 info.prefix)
    dist.init_process_group(backend, **kwargs)


def silent_peers(beats: dict[int, dict[str, Any]], *, rank: int, attempt: int,
                 silence_s: float) -> list[int]:
    """The peers of ``attempt`` whose last beat, in a watched phase, is older than the
    freshest beat of the attempt by more than ``silence_s``, and not of this host with
    a process gone. Measured against the freshest beat, not this host's clock: hosts'
    clocks differ, and after a Redis outage every beat is old together."""
    ours = {r: b for r, b in beats.items() if b.get("attempt") == attempt}
    freshest = max((float(b.get("alive_at") or 0.0) for b in ours.values()), default=0.0)
    return [r for r, b in sorted(ours.items())
            if r != rank and b.get("phase") not in (None, "idle")
            and freshest - float(b.get("alive_at") or 0.0) > silence_s
            and not (b.get("host") == HOST and not pid_alive(int(b.get("pid") or 0)))]


def thread_stacks() -> dict[str, list[str]]:
    """Every thread's stack now, innermost frame last, keyed by ``name (ident)``."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = {}
    for ident, frame in sys._current_frames().items():
        out[f"{names.get(ident, '?')} ({ident})"] = [
            line.rstrip("\n") for line in traceback.format_stack(frame)]
    return out


class StepTimes:
    """The last ``size`` step durations and their p99."""

    def __init__(self, size: int = 512) -> None:
        self._d: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._d.append(seconds)

    def __len__(self) -> int:
        return len(self._d)

    def p99(self) -> float | None:
        if not self._d:
            return None
        ordered = sorted(self._d)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class Watchdog:
    """One process's watchdog thread (see the module docstring).

    ``beat(doc)`` is called every ``heartbeat_s`` with this rank's heartbeat fields;
    ``fire(report)`` when the budget ran out (it writes the report; the watchdog then
    exits the process); a checker's ``peers(silence_s)``, the silent peers (see
    :func:`silent_peers`), while its phase stalled past ``peer_silence_s``. Callbacks run
    on the watchdog's thread and must not block long: they are the session's Redis
    calls, on a client with short timeouts."""

    def __init__(self, config: WatchdogConfig, *, beat: Callable[[dict[str, Any]], None],
                 fire: Callable[[dict[str, Any]], None],
                 peers: Callable[[float], list[int]] | None = None,
                 exit: Callable[[int], None] = os._exit) -> None:
        self.config = config
        self._peers = peers if config.peer_silence_s > 0 else None
        self._silent: dict[int, float] = {}  # silent peer -> when we first saw it so
        self.times = StepTimes()
        self._beat, self._fire, self._exit = beat, fire, exit
        self._lock = threading.Lock()
        self._phase = "startup"
        self._limit: float | None = config.startup_s
        self._since = time.monotonic()  # last progress or phase change
        self._progress_at = time.time()
        self.step = 0
        self.records = 0
        self.batch: str | None = None
        self._warm = False
        self._stop = threading.Event()
        self._failing = False  # the last callback failed (logged once per streak)
        self._thread = threading.Thread(target=self._run, name="trainguard-watchdog",
                                        daemon=True)
        if config.enabled:
            self._thread.start()

    # ------------------------------------------------------------------ what the session says

    def _set(self, phase: str, limit_s: float | None) -> None:
        self._phase, self._limit, self._since = phase, limit_s, time.monotonic()

    @contextlib.contextmanager
    def phase(self, name: str, limit_s: float | None = None) -> Iterator[None]:
        """Run the block under ``name``'s budget (``limit_s`` overrides it), then go
        back to the phase before, its clock restarted (the block's time is no step)."""
        with self._lock:
            before = self._phase
            p99 = self.times.p99() if len(self.times) >= self.config.min_steps else None
            self._set(name, limit_s if limit_s is not None
                      else self.config.phase_limit_s(name, p99))
        try:
            yield
        finally:
            with self._lock:
                self._set(before, self._limit_of(before))

    def _limit_of(self, phase: str) -> float | None:
        p99 = self.times.p99() if len(self.times) >= self.config.min_steps else None
        return self.config.phase_limit_s(phase, p99)

    def enter(self, phase: str) -> None:
        with self._lock:
            self._set(phase, self._limit_of(phase))

    def progress(self, step: int, batch: str | None, records: int) -> None:
        """A step ended (the loop asked for the next batch): learn its duration."""
        now = time.monotonic()
        with self._lock:
            if self._phase == "train" and self._warm:
                self.times.add(now - self._since)
            # The first step (compilation, caches, workers starting) is start-up's.
            self._warm = self._phase == "train"
            self.step, self.batch, self.records = step, batch, records
            self._progress_at = time.time()
            self._set("train", self._limit_of("train"))

    def collective_timeout_s(self) -> float:
        """The collective timeout for the current phase: half as long again as its
        budget (so that the watchdog, whose report names the stalled rank and holds
        the stacks, fires first; the timeout is the backstop), within the ceiling."""
        with self._lock:
            limit = self._limit if self._limit is not None else self.config.startup_s
        return min(1.5 * limit + self.config.heartbeat_s, self.config.ceiling_s)

    @property
    def phase_name(self) -> str:
        return self._phase

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # ------------------------------------------------------------------ the thread

    def heartbeat(self) -> dict[str, Any]:
        with self._lock:
            return {"phase": self._phase, "step": self.step, "records": self.records,
                    "batch": self.batch, "every_s": self.config.heartbeat_s,
                    "progress_at": self._progress_at, "alive_at": time.time()}

    def _check_peers(self, now: float) -> list[int]:
        """The peers silent for ``peer_silence_s`` and, on our clock, a confirmation
        window more (forgotten as soon as they beat again)."""
        assert self._peers is not None
        got = self._call(self._peers, self.config.peer_silence_s) or []
        self._silent = {r: self._silent.get(r, now) for r in got}
        return [r for r, t in self._silent.items() if now - t >= self.config.confirm_s()]

    def _run(self) -> None:
        last_beat = 0.0
        poll = min(0.25, self.config.heartbeat_s / 2)
        tick = time.monotonic()
        while not self._stop.wait(poll):
            now = time.monotonic()
            gap, tick = now - tick, now
            with self._lock:
                if gap > 20 * poll + 1.0:
                    # This thread did not run for a long while: the whole process was
                    # stopped (SIGSTOP, a suspended job, a debugger), not the loop
                    # alone. That pause is no stall of ours: restart the clock (the
                    # peers judge it from their side).
                    self._since += gap
                phase, limit, stalled = self._phase, self._limit, now - self._since
            if now - last_beat >= self.config.heartbeat_s:
                last_beat = now
                self._call(self._beat, self.heartbeat())
                if self._peers is not None and limit is not None \
                        and stalled > self.config.peer_silence_s:
                    silent = self._check_peers(now)
                    if silent:
                        self._fire_now(phase, self.config.peer_silence_s, stalled,
                                       silent=silent)
                        return
                else:
                    self._silent = {}
            if limit is not None and stalled > limit:
                self._fire_now(phase, limit, stalled)
                return

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """``fn(arg)``, or None when it failed (logged once per streak)."""
        try:
            result = fn(arg)
        except Exception as exc:  # a failing write must not stop the watching
            if not self._failing:
                log.warning("watchdog: %s failed (%s: %s); retrying every beat",
                            getattr(fn, "__name__", fn), type(exc).__name__, exc)
            self._failing = True
            return None
        self._failing = False
        return result

    def _fire_now(self, phase: str, limit: float, stalled: float, *,
                  silent: list[int] | None = None) -> None:
        """Report and exit: the phase's budget ran out, or (``silent``) peers stopped
        beating while this rank made no progress for ``limit`` (``peer_silence_s``)."""
        beat = self.heartbeat()
        p99 = self.times.p99()
        report = {"cause": HANG, "at": time.time(), "phase": phase, "step": beat["step"],
                  "batch": beat["batch"], "stalled_s": stalled, "limit_s": limit,
                  "trigger": "budget" if silent is None else "peer_silence",
                  **({} if silent is None else {"silent": silent}),
                  "p99_step_s": p99, "steps_measured": len(self.times),
                  "stacks": thread_stacks(), "heartbeat": beat}
        why = (f"budget {limit:.1f} s" if silent is None else
               f"ranks {silent} beat nothing for {limit:.1f} s")
        log.critical("watchdog: no progress for %.1f s in phase %r at step %d (%s, p99 step "
                     "%s s): dumping stacks and exiting with code %d", stalled, phase,
                     beat["step"], why, None if p99 is None else round(p99, 3), EXIT_HUNG)
        self._call(self._fire, report)
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        self._exit(EXIT_HUNG)
