"""The session's record of its attempts and failures in Redis, and the restart-loop
breaker's remedy for this attempt (format and decision: :mod:`trainguard.core.incidents`).

Kept apart from ``session.py``, which calls it at five points: ``start`` (the
constructor: register this attempt, turn the previous one's failure into an incident,
decide the remedy), ``restored``, ``first_step``, ``closed``, and the watchdog's
callbacks (heartbeat, hang report). An unhandled exception in the main thread is
reported by the excepthook installed here (an error carrying an ``exit_code`` of
ours, e.g. :class:`~trainer_client.errors.RestartLoopError`, then exits with it).
Python calls no excepthook for ``SystemExit``: an exit of the interpreter before
``session.close()`` (``sys.exit(3)`` in the script) is reported by an atexit hook, with
the code ``sys.exit`` was given (the wrapper installed here records it; a bare
``raise SystemExit`` or the script's end reports no code).

Only rank 0 writes attempts and incidents; every rank writes its own heartbeat and,
as it fails, its report. The writes of the watchdog thread and the excepthook use a
client of their own with short timeouts: a hung Redis must not hang the report of a
hang.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

import redis

from trainer_client import redis_client
from trainer_client.errors import GpuCriticalError, RestartLoopError
from trainer_client.watchdog import HOST as _HOST  # what heartbeats carry, what it compares
from trainguard.core import incidents as inc
from trainguard.core import settings
from trainguard.core.exit_codes import EXIT_RESTART_LOOP
from trainguard.core.process import forked_at, pid_alive, started_at

__all__ = ["IMPORTED_AT", "AttemptLog"]

log = logging.getLogger("trainer_client.session")

IMPORTED_AT = time.time()
"""When ``trainer_client`` finished importing (torch with it): the end of "imports"."""

_SYS_EXIT = sys.exit


class AttemptLog:
    """One process's part of its run's attempts and incidents (see the module docstring)."""

    def __init__(self, redis_url: str, *, dataset: str, run: str, rank: int, world_size: int,
                 call: Callable[..., Any], broadcast: Callable[[Any], Any],
                 policy: inc.LoopPolicy) -> None:
        self.dataset, self.run, self.rank, self.world_size = dataset, run, rank, world_size
        self._call, self._broadcast, self.policy = call, broadcast, policy
        self._r = redis_client.client(redis_url, socket_timeout=30, socket_connect_timeout=5)
        # The watchdog thread's and the excepthook's: short timeouts, no retries.
        self._quick = redis_client.client(redis_url, socket_timeout=3, socket_connect_timeout=3)
        self.attempt = 0
        self.remedy = inc.Remedy("restore", 0)
        self.incident: dict[str, Any] | None = None  # the previous attempt's failure
        self.failures = 0
        self.step_of: Callable[[], tuple[int, str | None, str]] = lambda: (0, None, "startup")
        self._first_step_done = False
        self._redone: int | None = None
        self._rollbacks = 0
        self._hook_prev: Any = None
        self._exit_prev: Any = None
        self._exit_code: tuple[int | None] | None = None  # what sys.exit was given
        self._ended = False
        self._pid = os.getpid()

    # ------------------------------------------------------------------ keys

    def _k(self, fn: Callable[[str, str], str]) -> str:
        return fn(self.dataset, self.run)

    def _load_hash(self, key: str) -> dict[str, dict[str, Any]]:
        out = {}
        for field, raw in (self._call(self._r.hgetall, key) or {}).items():
            name = field.decode() if isinstance(field, bytes) else str(field)
            if name == "seq":
                continue
            try:
                out[name] = inc.loads(raw)
            except inc.IncidentError as exc:
                log.warning("ignoring %s field %s: %s", key, name, exc)
        return out

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Register this attempt (rank 0), assemble the previous attempt's failure and
        decide the remedy; every rank learns the attempt, the remedy and the incident."""
        plan: dict[str, Any] = {}
        if self.rank == 0:
            plan = self._register()
        plan = self._broadcast(plan)
        self.attempt = int(plan["attempt"])
        self.remedy = inc.Remedy(**plan["remedy"])
        self.incident = plan["incident"]
        self.failures = int(plan["failures"])
        self._install_hook()

    def _register(self) -> dict[str, Any]:
        r, akey = self._r, self._k(inc.attempts_key)
        n = int(self._call(r.hincrby, akey, "seq", 1))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        # A warm worker (forked by trainguard.elastic.warm's zygote) had its imports
        # at the fork: IMPORTED_AT is the zygote's, long before this process existed.
        doc = {"attempt": n, "pid": os.getpid(), "host": _HOST, "world_size": self.world_size,
               "restart_count": None if restart is None else int(restart),
               "rendezvous_at": _rendezvous_at(),
               "started_at": started_at(),
               "imported_at": max(IMPORTED_AT, forked_at() or 0.0), "session_at": time.time(),
               "restored_at": None, "restored_step": None, "first_step_at": None,
               "outcome": "running"}
        self._call(r.hset, akey, str(n), inc.dumps(doc))
        if n > inc.ATTEMPTS_KEPT:
            self._call(r.hdel, akey, str(n - inc.ATTEMPTS_KEPT))  # "seq" keeps the count
        incidents = self._load_hash(self._k(inc.incidents_key))
        prev = self._load_hash(akey).get(str(n - 1))
        incident = None
        if prev is not None and prev.get("outcome") == "running":
            if self._still_running(prev):
                # A takeover, not a failure: the older trainer lives on (a zombie, fenced
                # by this restore) and reports nothing; the breaker must not count it.
                self._call(r.hset, akey, str(n - 1),
                           inc.dumps({**prev, "outcome": "superseded"}))
            else:
                incident = self._assemble(prev)
                self._call(r.hset, akey, str(n - 1), inc.dumps({**prev, "outcome": "failed"}))
        ordered = [incidents[k] for k in sorted(incidents, key=inc.field_order)]
        fresh = restart in (None, "0")
        if incident is not None:
            ordered.append(incident)
        failed = [i for i in ordered if i.get("cause") != inc.ROLLBACK]
        if incident is not None:
            remedy = inc.decide(ordered, self.policy, fresh_launch=fresh)
        elif not fresh and failed[-1:] and failed[-1].get("cause") == inc.RESTART_LOOP:
            remedy = inc.Remedy("refuse", 0)  # the agent restarts a stopped run
        else:
            remedy = inc.Remedy("restore", 0)
        if incident is not None:
            incident["remedy"] = remedy.to_json()
            self._call(r.hset, self._k(inc.incidents_key), str(n - 1), inc.dumps(incident))
            self._trim(incidents)
        failures = sum(1 for i in ordered if i.get("cause") not in inc.NOT_FAILURES)
        return {"attempt": n, "remedy": remedy.to_json(), "incident": incident,
                "failures": failures}

    def _still_running(self, prev: dict[str, Any]) -> bool:
        """Whether the previous attempt's rank 0 still runs: its process, on this host;
        on another, a heartbeat that moves on while we wait two beats."""
        pid = int(prev.get("pid") or 0)
        if prev.get("host") == _HOST:
            return pid > 0 and pid_alive(pid)  # our own pid too: a session made twice
        beat = self._load_hash(self._k(inc.alive_key)).get("0") or {}
        if beat.get("attempt") != prev.get("attempt"):
            return False
        every = float(beat.get("every_s") or 1.0)
        if time.time() - float(beat.get("alive_at") or 0.0) > 3 * every:
            return False
        time.sleep(2 * every)
        again = self._load_hash(self._k(inc.alive_key)).get("0") or {}
        return float(again.get("alive_at") or 0.0) > float(beat.get("alive_at") or 0.0)

    def _assemble(self, prev: dict[str, Any]) -> dict[str, Any]:
        n = int(prev["attempt"])
        reports = [d for k, d in self._load_hash(self._k(inc.reports_key)).items()
                   if k.split(":")[0] == str(n)]
        beats = list(self._load_hash(self._k(inc.alive_key)).values())
        return inc.assemble(prev, reports, beats, now=time.time())

    def _trim(self, incidents: dict[str, Any]) -> None:
        old = sorted(incidents, key=inc.field_order)[:-inc.INCIDENTS_KEPT]
        if old:
            self._call(self._r.hdel, self._k(inc.incidents_key), *old)
            self._call(self._r.hdel, self._k(inc.reports_key),
                       *[f"{a}:{rk}" for a in old for rk in range(self.world_size)])

    # ------------------------------------------------------------------ the breaker's verdicts

    def stop_if_looping(self) -> None:
        """Raise RestartLoopError when the remedy is to stop (writing the incident that
        says what was tried) or the breaker is open (a restart of a stopped run)."""
        action = self.remedy.action
        if action not in ("stop", "refuse"):
            return
        last = self.incident or {}
        if action == "stop" and self.rank == 0:
            doc = {"attempt": self.attempt, "cause": inc.RESTART_LOOP,
                   "detected_by": "restart-loop breaker", "detected_at": time.time(),
                   "failed_at": last.get("failed_at"), "detection_latency_s": 0.0,
                   "step": last.get("step"), "signature": last.get("signature"),
                   "repeats": self.remedy.repeats, "tried": list(self.remedy.tried),
                   "look_at": _look_at(last), "world_before": self.world_size,
                   "remedy": self.remedy.to_json(), "recovery": None,
                   "job_stop": bool(settings.rdzv_worker())}  # every agent told to exit
            self._call(self._r.hset, self._k(inc.incidents_key), str(self.attempt),
                       inc.dumps(doc))
            self._end("stopped")
        elif self.rank == 0:
            self._end("refused")
        if action == "stop":
            msg = (f"run {self.run!r}: the same failure ({last.get('signature')}) came back "
                   f"{self.remedy.repeats} times in a row after "
                   f"{', '.join(self.remedy.tried) or 'a restore'}: stopping (exit "
                   f"{EXIT_RESTART_LOOP}, not retryable). {_look_at(last)} `trainguard "
                   f"runs show {self.run}` has the incidents; a fresh launch starts over.")
        else:
            msg = (f"run {self.run!r} was stopped by the restart-loop breaker and this is "
                   f"a restart by the agent: refusing to train (exit "
                   f"{EXIT_RESTART_LOOP}). Read `trainguard runs show {self.run}`, fix "
                   "the cause, then launch the job again.")
        if settings.rdzv_worker():
            # Under the trainguard rendezvous every rank tells the agents not to restart
            # it (torchrun would, until --max-restarts ran out, each attempt refused).
            from trainguard.elastic.worker import stop_job

            stop_job(reason=msg, exit_code=EXIT_RESTART_LOOP, rank=self.rank)
        raise RestartLoopError(msg, exit_code=EXIT_RESTART_LOOP)

    def skipped_batch(self) -> str | None:
        """The batch this rank had in flight when the failure struck, when the remedy
        is to skip it."""
        if self.remedy.action != "skip_batches" or not self.incident:
            return None
        batch = (self.incident.get("batches") or {}).get(str(self.rank))
        return None if batch is None else str(batch)

    # ------------------------------------------------------------------ progress marks

    def _update(self, **fields: Any) -> None:
        if self.rank != 0:
            return
        key = self._k(inc.attempts_key)
        raw = self._call(self._r.hget, key, str(self.attempt))
        doc = inc.loads(raw) if raw else {"attempt": self.attempt}
        self._call(self._r.hset, key, str(self.attempt), inc.dumps({**doc, **fields}))

    def restored(self, step: int, generation: int | None) -> None:
        self._update(restored_at=time.time(), restored_step=step, generation=generation)

    def first_step(self) -> None:
        if self._first_step_done:
            return
        self._first_step_done = True
        self._update(first_step_at=time.time())
        self._recover()

    def caught_up(self, records: int) -> None:
        """The loop got back to the failed step: ``records`` were trained again."""
        self._redone = records
        self._recover()

    def _recover(self) -> None:
        if self.rank != 0 or self.incident is None:
            return
        raw = self._call(self._r.hget, self._k(inc.attempts_key), str(self.attempt))
        rec = inc.recovery(self.incident, inc.loads(raw), self._redone)
        self._call(self._r.hset, self._k(inc.incidents_key), str(self.incident["attempt"]),
                   inc.dumps({**self.incident, "recovery": rec}))

    def rolled_back(self, *, from_step: int, to_step: int, reason: str | None) -> None:
        """A rollback (a loss spike's, or the script's own ``session.rollback``): an
        incident of this attempt, which goes on."""
        self._rollbacks += 1
        if self.rank != 0:
            return
        now = time.time()
        doc = {"attempt": self.attempt, "cause": inc.ROLLBACK,
               "detected_by": "loss spike guard" if reason else "session.rollback",
               "reason": reason, "detected_at": now, "failed_at": now,
               "detection_latency_s": 0.0, "step": from_step, "to_step": to_step,
               "signature": f"rollback step={from_step}", "world_before": self.world_size,
               "remedy": {"action": "rollback", "repeats": 0, "tried": []},
               "recovery": {"world_after": self.world_size, "restored_step": to_step,
                            "steps_redone": max(0, from_step - to_step)}}
        self._call(self._r.hset, self._k(inc.incidents_key),
                   f"{self.attempt}.{self._rollbacks}", inc.dumps(doc))

    def closed(self) -> None:
        self._end("ok")

    def _end(self, outcome: str) -> None:
        self._ended = True
        self._update(outcome=outcome, ended_at=time.time())

    def close(self) -> None:
        if sys.excepthook is self._excepthook and self._hook_prev is not None:
            sys.excepthook = self._hook_prev
        if sys.exit is self._sys_exit and self._exit_prev is not None:
            sys.exit = self._exit_prev
        atexit.unregister(self._at_exit)
        self._r.close()
        self._quick.close()

    # ------------------------------------------------------------------ what a failing rank says

    def heartbeat(self, doc: dict[str, Any]) -> None:
        """The watchdog's beat: this rank's progress, for its peers and the next attempt."""
        full = {**doc, "attempt": self.attempt, "rank": self.rank, "pid": os.getpid(),
                "host": _HOST}
        self._quick.hset(self._k(inc.alive_key), str(self.rank), inc.dumps(full))

    def beats(self) -> dict[int, dict[str, Any]]:
        """Every rank's last heartbeat, by rank (raises RedisError)."""
        raw = self._quick.hgetall(self._k(inc.alive_key)) or {}
        return {int(k): inc.loads(v) for k, v in raw.items()}

    def report(self, doc: dict[str, Any]) -> None:
        full = {**doc, "attempt": self.attempt, "rank": self.rank, "pid": os.getpid(),
                "host": _HOST}
        # The first word of a rank wins: after the watchdog fired (and killed a stopped
        # peer), the main thread's collective fails too, and must not overwrite it.
        self._quick.hsetnx(self._k(inc.reports_key), f"{self.attempt}:{self.rank}",
                           inc.dumps(full))

    def gpu_critical(self, exc: GpuCriticalError) -> None:
        """This rank's GPU (or, :class:`PeerGpuCriticalError`, a peer's) reported
        CRITICAL and the process exits with ``exc.exit_code``: its own cause class."""
        step, batch, phase = self.step_of()
        with contextlib.suppress(redis.RedisError):
            self.report({"cause": inc.GPU_CRITICAL, "at": time.time(), "step": step,
                         "batch": batch, "phase": phase, "exit_code": exc.exit_code,
                         "error": {"type": type(exc).__name__, "message": str(exc)[:2000]},
                         "thread": threading.current_thread().name})

    def hang(self, report: dict[str, Any]) -> None:
        """The watchdog fired: name the ranks whose heartbeat stopped, write the report
        with its final heartbeat, kill the stopped ranks of this host."""
        beats = {}
        with contextlib.suppress(redis.RedisError, inc.IncidentError):
            beats = self.beats()
        # A live rank beats every heartbeat_s; a stopped one stopped when the stall began.
        stale_after = max(2 * float(report.get("heartbeat_s") or 1.0),
                          0.5 * float(report.get("stalled_s") or 0.0))
        suspects = sorted(set(report.get("silent") or ()) | {
            r for r, b in beats.items() if r != self.rank and b.get("attempt") == self.attempt
            and time.time() - float(b.get("alive_at") or 0.0) > stale_after})
        report = {**report, "suspects": suspects}
        with contextlib.suppress(redis.RedisError):
            self.heartbeat(report["heartbeat"])
        with contextlib.suppress(redis.RedisError):
            self.report(report)
        if report.get("kill_stalled_peers"):
            for r in suspects:
                b = beats[r]
                pid = int(b.get("pid") or 0)
                if b.get("host") == _HOST and pid > 0 and pid != os.getpid() and pid_alive(pid):
                    log.critical("watchdog: rank %d (pid %d) stopped beating: killing it", r, pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def _install_hook(self) -> None:
        if sys.excepthook is not self._excepthook:
            self._hook_prev = sys.excepthook
            sys.excepthook = self._excepthook
        if sys.exit is not self._sys_exit:
            self._exit_prev = sys.exit
            sys.exit = self._sys_exit
        atexit.register(self._at_exit)

    def _sys_exit(self, status: str | int | None = None) -> NoReturn:
        """``sys.exit``, remembering the process's exit code for :meth:`_at_exit`
        (only the main thread's: elsewhere SystemExit ends a thread, not the process)."""
        if threading.current_thread() is threading.main_thread() and os.getpid() == self._pid:
            # As the interpreter maps it: None is 0, an int itself, anything else 1.
            code = 0 if status is None else status if isinstance(status, int) else 1
            self._exit_code = (code,)
        (self._exit_prev or _SYS_EXIT)(status)
        raise SystemExit(status)  # not reached: the exit above raises it

    def _at_exit(self) -> None:
        """The interpreter exits with the attempt still running (no ``session.close()``):
        report an exit, with its code, rather than leave the next attempt to guess
        ``killed``. After an unhandled exception the excepthook's report came first
        and stays (:meth:`report` keeps a rank's first word)."""
        if self._ended or os.getpid() != self._pid:
            return
        step, batch, phase = self.step_of()
        code = self._exit_code[0] if self._exit_code else None
        with contextlib.suppress(redis.RedisError):
            self.report({"cause": inc.EXIT, "at": time.time(), "step": step, "batch": batch,
                         "phase": phase, "exit_code": code,
                         "via": "sys.exit" if self._exit_code else "interpreter exit",
                         "thread": threading.main_thread().name})

    def _excepthook(self, kind: type[BaseException], exc: BaseException,
                    tb: TracebackType | None) -> None:
        if os.getpid() != self._pid:
            # A forked child (a DataLoader worker) inherited the hook, not the attempt.
            (self._hook_prev or sys.__excepthook__)(kind, exc, tb)
            return
        frames = traceback.extract_tb(tb)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
        step, batch, phase = self.step_of()
        if isinstance(exc, GpuCriticalError):
            self.gpu_critical(exc)
        elif not isinstance(exc, RestartLoopError):
            with contextlib.suppress(redis.RedisError):
                self.report({"cause": inc.CRASH, "at": time.time(), "step": step,
                             "batch": batch, "phase": phase, "where": where,
                             "error": {"type": kind.__name__, "message": str(exc)[:2000]},
                             "thread": threading.current_thread().name})
        (self._hook_prev or sys.__excepthook__)(kind, exc, tb)
        code = getattr(exc, "exit_code", None)
        if isinstance(code, int):
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(code)


def _rendezvous_at() -> float | None:
    """When the round this worker was spawned for closed (the agent's rendezvous
    handler says, in the environment it passes on); None outside that backend."""
    raw = os.environ.get(inc.RDZV_CLOSED_ENV)
    try:
        return None if raw is None else float(raw)
    except ValueError:
        return None


def _look_at(incident: dict[str, Any]) -> str:
    reports = incident.get("reports") or []
    first = min(reports, key=lambda r: float(r.get("at") or 0.0)) if reports else {}
    err = first.get("error") or {}
    parts = [f"Look at step {incident.get('step')}"]
    if err:
        parts.append(f"where {err.get('type')} was raised ({first.get('where')}: "
                     f"{str(err.get('message'))[:200]})")
    if incident.get("cause") == inc.HANG:
        parts.append(f"where rank(s) {first.get('suspects') or [first.get('rank')]} stalled "
                     f"in phase {first.get('phase')} (the report holds every thread's stack)")
    if incident.get("cause") == inc.EXIT:
        parts.append(f"where the script exited (code {incident.get('exit_code')}) before "
                     "session.close()")
    if incident.get("batches"):
        parts.append(f"and at the batches {incident['batches']}")
    return " ".join(parts) + "."
