"""Attempts and incidents: what a run's processes write to Redis about each start and
each failure, so that restarts are counted (those that die before their first
checkpoint too), every failure has one machine-readable record, and a failure that
repeats after each restore is recognised (the restart-loop breaker's decision, made
here as a pure function).

Key layout for run ``R`` of dataset ``D`` (in the dataset's hash slot, beside the
run's ``committed`` and ``floor`` hashes of :mod:`trainguard.core.streams`)::

    tg:{D}:attempts:<R>     HASH   "seq" -> attempts so far; "<n>" -> attempt n (JSON)
    tg:{D}:alive:<R>        HASH   "<rank>" -> the rank's heartbeat (JSON, newest attempt)
    tg:{D}:reports:<R>      HASH   "<n>:<rank>" -> what rank said as it failed (JSON)
    tg:{D}:incidents:<R>    HASH   "<n>" -> the incident of attempt n's failure (JSON);
                                   "<n>.<k>" -> attempt n's k-th rollback (JSON)

Documents (all carry ``version``; readers refuse newer ones)::

    attempt    {"attempt", "pid", "host", "world_size", "restart_count" (torchrun's
                TORCHELASTIC_RESTART_COUNT, null outside torchrun), "started_at" (the
                process start, unix s), "rendezvous_at" (when the trainguard
                rendezvous round that spawned it closed; null under other backends), "imported_at", "session_at", "restored_at",
                "restored_step", "first_step_at", "outcome": running|ok|failed}
    heartbeat  {"attempt", "rank", "pid", "host", "alive_at", "progress_at", "phase",
                "step" (in flight), "records" (consumed since the restore), "batch"
                (in flight)}
    report     {"attempt", "rank", "cause": hang|crash|exit|gpu_critical, "at", "step", "phase", "batch",
                "error" (type and message), "where" (innermost file:line), "stacks"
                (hang: every thread's stack), "stalled_s", "limit_s", "suspects",
                "exit_code" (exit: what ``sys.exit`` was given, null when unknown),
                "via" (exit: ``sys.exit`` or ``interpreter exit``)}
    incident   {"version", "attempt" (the failed one), "cause": hang|crash|exit|
                gpu_critical|killed|
                restart_loop|rollback (a loss spike's: no failure, the attempt goes
                on; "to_step", "reason"), "detected_by", "detected_at", "failed_at",
                "detection_latency_s", "step", "signature", "batches" ({rank: batch}),
                "exit_code" (exit: the first reporting rank's code),
                "reports" (the failed ranks' reports), "world_before", "remedy" (what
                the next attempt does), "recovery" (filled by the next attempt: world
                after, restored step, steps redone and the records all its ranks trained
                again up to the failed step, the time to its first step by phase)}

A process that dies without a word (SIGKILL, the OOM killer, a lost node) leaves its
attempt ``running`` and no report: the next attempt calls that failure ``killed``,
dated by the last heartbeat. A process that exits (``sys.exit(3)``) before
``session.close()`` reports ``exit`` with its code as it goes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trainguard.core.errors import TrainguardError
from trainguard.core.streams import PREFIX

__all__ = [
    "INCIDENT_VERSION",
    "RDZV_CLOSED_ENV",
    "IncidentError",
    "LoopPolicy",
    "Remedy",
    "RemedyAction",
    "alive_key",
    "assemble",
    "attempts_key",
    "decide",
    "documents",
    "dumps",
    "field_order",
    "incidents_key",
    "loads",
    "recovery",
    "reports_key",
]

INCIDENT_VERSION = 1
INCIDENTS_KEPT = 200
"""The incidents hash is trimmed to the newest this many (their reports with them)."""
ATTEMPTS_KEPT = 1000
"""The attempts hash keeps the newest this many documents ("seq" counts them all)."""


HANG, CRASH, KILLED, RESTART_LOOP = "hang", "crash", "killed", "restart_loop"
EXIT = "exit"
GPU_CRITICAL = "gpu_critical"
"""A GPU health probe reported CRITICAL: the node leaves (exit 75; its peers 76). A
fault of the node, not of the code or the data: restored plainly, climbs no ladder."""
"""The interpreter exited (``SystemExit``) before ``session.close()``: reported, with
the exit code, so it climbs the breaker's ladder as a crash does."""
ROLLBACK = "rollback"
NOT_FAILURES = (RESTART_LOOP, ROLLBACK)
"""Incident causes that are no failure of an attempt (not counted, climb no ladder)."""


def field_order(name: str) -> tuple[int, int]:
    """The order of an incidents-hash field: ``"<n>"`` (a failure) before ``"<n>.<k>"``
    (attempt n's rollbacks)."""
    attempt, _, k = name.partition(".")
    return int(attempt), int(k or 0)


class IncidentError(TrainguardError, ValueError):
    """An attempt or incident document is malformed, or newer than this trainguard."""


def attempts_key(dataset: str, run: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:attempts:{run}"


def alive_key(dataset: str, run: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:alive:{run}"


def reports_key(dataset: str, run: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:reports:{run}"


def incidents_key(dataset: str, run: str) -> str:
    return f"{PREFIX}:{{{dataset}}}:incidents:{run}"


def dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps({"version": INCIDENT_VERSION, **doc}, separators=(",", ":"),
                      default=str)


def loads(raw: str | bytes) -> dict[str, Any]:
    """A document written by :func:`dumps`; IncidentError when it is not one."""
    try:
        doc = json.loads(raw)
    except (TypeError, ValueError) as exc:
        raise IncidentError(f"an attempt/incident document is not JSON ({exc}): "
                            f"{str(raw)[:80]!r}") from exc
    if not isinstance(doc, dict):
        raise IncidentError(f"an attempt/incident document is a {type(doc).__name__}, "
                            "expected a JSON object")
    version = doc.get("version")
    if not isinstance(version, int) or version > INCIDENT_VERSION:
        raise IncidentError(f"an attempt/incident document has version {version!r}, this "
                            f"trainguard reads up to {INCIDENT_VERSION}: upgrade trainguard")
    return doc


def documents(raw: Mapping[Any, Any] | None,
              on_bad: Callable[[str, IncidentError], None] | None = None
              ) -> dict[str, dict[str, Any]]:
    """The documents of an attempts or incidents hash as HGETALL returns it (bytes or
    text), by field; the ``seq`` counter is no document. One that does not load is
    left out (a history shows what it can) and handed to ``on_bad`` with its field."""
    out: dict[str, dict[str, Any]] = {}
    for field, value in (raw or {}).items():
        name = field.decode() if isinstance(field, bytes) else str(field)
        if name == "seq":
            continue
        try:
            out[name] = loads(value)
        except IncidentError as exc:
            if on_bad is not None:
                on_bad(name, exc)
    return out


# ------------------------------------------------------------------ one incident per failure


def _primary(reports: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    # The earliest report is the origin: a peer's error ("connection closed" in its
    # collective) comes after the exception or the stall that caused it.
    return min(reports, key=lambda r: float(r.get("at") or 0.0)) if reports else None


def signature(cause: str, step: int | None, report: Mapping[str, Any] | None) -> str:
    """What makes two failures "the same": the cause, the step and (for a crash) the
    error's type and where it was raised; (for a hang) the phase it stalled in."""
    parts = [cause, f"step={step}"]
    if report is not None and cause == CRASH:
        parts += [str((report.get("error") or {}).get("type")), str(report.get("where"))]
    elif report is not None and cause == HANG:
        parts.append(f"phase={report.get('phase')}")
    elif report is not None and cause == EXIT:
        parts.append(f"code={report.get('exit_code')}")
    return " ".join(parts)


def assemble(attempt: Mapping[str, Any], reports: Sequence[Mapping[str, Any]],
             heartbeats: Sequence[Mapping[str, Any]], *, now: float) -> dict[str, Any]:
    """The incident of the failed ``attempt`` from what its ranks reported and their
    last heartbeats (``now``: when the next attempt noticed)."""
    first = _primary(reports)
    beats = [h for h in heartbeats if h.get("attempt") == attempt.get("attempt")]
    last_alive = max((float(h.get("alive_at") or 0.0) for h in beats), default=None)
    last_progress = max((float(h.get("progress_at") or 0.0) for h in beats), default=None)
    if first is not None:
        cause = str(first.get("cause") or CRASH)
        detected_at = float(first.get("at") or now)
        step = first.get("step")
        detected_by = {HANG: "watchdog", EXIT: "exit hook",
                       GPU_CRITICAL: "GPU health probe"}.get(cause, "exception")
    else:
        cause, detected_at, detected_by = KILLED, now, "next attempt"
        step = max((int(h.get("step") or 0) for h in beats), default=None)
    failed_at = (last_progress if cause == HANG else last_alive) or detected_at
    if first is not None and cause in (CRASH, EXIT, GPU_CRITICAL):
        failed_at = detected_at
    # Only what the ranks said as they failed: a heartbeat's batch may be a step old.
    batches = {str(r["rank"]): r.get("batch") for r in reports if r.get("batch")}
    return {
        "attempt": attempt.get("attempt"), "cause": cause, "detected_by": detected_by,
        "detected_at": detected_at, "failed_at": failed_at,
        "detection_latency_s": max(0.0, detected_at - failed_at),
        "step": step, "signature": signature(cause, step, first), "batches": batches,
        "reports": list(reports), "world_before": attempt.get("world_size"),
        **({"exit_code": first.get("exit_code")}
           if first is not None and cause in (EXIT, GPU_CRITICAL) else {}),
        "restored_step_before": attempt.get("restored_step"),
        "heartbeats": [{k: h.get(k) for k in ("rank", "step", "records", "progress_at",
                                               "alive_at")} for h in beats],
        "remedy": None, "recovery": None,
    }


RDZV_CLOSED_ENV = "TRAINGUARD_RDZV_CLOSED_AT"
"""Set by the trainguard rendezvous handler in its agent's environment when a round
closes (unix s); the workers it then spawns inherit it (torch's subprocess handler
copies the agent's ``os.environ``), and the attempt records it as ``rendezvous_at``."""


def _restart_marks(incident: Mapping[str, Any], attempt: Mapping[str, Any]
                   ) -> list[tuple[str, Any, Any]]:
    """detect → process start: one "restart" phase, or, when the attempt knows when
    its rendezvous round closed, "rendezvous" (agent stop and the round) and "spawn"."""
    closed = attempt.get("rendezvous_at")
    failed = incident.get("failed_at")
    # A round closed before the failure is not this recovery's: the variable came from
    # an earlier round's environment (a shell or a test process that ran a handler).
    if closed is None or (failed is not None and float(closed) < float(failed)):
        return [("restart", incident.get("detected_at"), attempt.get("started_at"))]
    return [("rendezvous", incident.get("detected_at"), closed),
            ("spawn", closed, attempt.get("started_at"))]


def recovery(incident: Mapping[str, Any], attempt: Mapping[str, Any],
             records_redone: int | None = None) -> dict[str, Any]:
    """What the attempt after ``incident`` redid and how long it took to train again,
    split into the phases one can observe from inside the job (seconds; None where a
    phase's end was not recorded). ``records_redone``: the records all ranks trained
    again up to the failed step (None until the attempt got there)."""
    restored = attempt.get("restored_step")
    step = incident.get("step")
    marks = [("detect", incident.get("failed_at"), incident.get("detected_at")),
             *(_restart_marks(incident, attempt)),
             ("imports", attempt.get("started_at"), attempt.get("imported_at")),
             ("session", attempt.get("imported_at"), attempt.get("session_at")),
             ("restore", attempt.get("session_at"), attempt.get("restored_at")),
             ("first_step", attempt.get("restored_at"), attempt.get("first_step_at"))]
    phases = {name: (None if a is None or b is None else max(0.0, float(b) - float(a)))
              for name, a, b in marks}
    total = (None if incident.get("failed_at") is None or attempt.get("first_step_at") is None
             else float(attempt["first_step_at"]) - float(incident["failed_at"]))
    return {
        "attempt": attempt.get("attempt"), "world_after": attempt.get("world_size"),
        "restored_step": restored,
        "steps_redone": (None if step is None or restored is None
                         else max(0, int(step) - int(restored))),
        "records_redone": records_redone, "phases_s": phases, "to_first_step_s": total,
    }


# ------------------------------------------------------------------ the restart-loop breaker


@dataclass(frozen=True)
class LoopPolicy:
    """When the same failure recurs after restores (see :func:`decide`)."""

    max_tries: int = 3
    """Remedies tried for one failure before the breaker stops the run: a plain
    restore, then the checkpoint before the newest, then skipping the batches in
    flight (a data-triggered failure); the next recurrence stops (exit 87)."""
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.max_tries < 1:
            raise ValueError(f"LoopPolicy.max_tries must be >= 1, got {self.max_tries}")

    @classmethod
    def from_env(cls, raw: str) -> LoopPolicy:
        """``$TRAINGUARD_LOOP_BREAKER`` as written: empty → the defaults, ``off``,
        or ``max_tries=N``."""
        text = raw.strip().lower()
        if text in ("", "on", "1", "true"):
            return cls()
        if text in ("off", "0", "false"):
            return cls(enabled=False)
        key, _, value = text.partition("=")
        if key != "max_tries" or not value.isdigit():
            raise ValueError(f"TRAINGUARD_LOOP_BREAKER={raw!r}: expected 'off' or "
                             "'max_tries=N' (N >= 1)")
        return cls(max_tries=int(value))


RemedyAction = Literal["restore", "older_checkpoint", "skip_batches", "stop", "refuse"]
"""What the next attempt does about the newest incident (:class:`Remedy`)."""


@dataclass(frozen=True)
class Remedy:
    action: RemedyAction
    """``restore`` (the newest checkpoint), ``older_checkpoint`` (the one before the
    newest the last try restored), ``skip_batches`` (restore, then skip ``batches``),
    ``stop`` (the breaker opened), ``refuse`` (it is open: a restart of a stopped run)."""
    repeats: int
    """How many failures in a row had this incident's signature."""
    tried: tuple[str, ...] = ()
    """The remedies already tried for it, oldest first."""

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "repeats": self.repeats, "tried": list(self.tried)}


LADDER: tuple[RemedyAction, ...] = ("restore", "older_checkpoint", "skip_batches")


def decide(incidents: Sequence[Mapping[str, Any]], policy: LoopPolicy, *,
           fresh_launch: bool) -> Remedy:
    """The remedy for the newest of ``incidents`` (oldest first).

    A run of failures with one signature climbs :data:`LADDER` one rung per failure
    (a skip only where every rank reported its batch in flight); past ``max_tries`` rungs it
    stops. Only failures that reported themselves (a crash's exception, a watchdog's
    hang) climb: a ``killed`` one is restored plainly. Once stopped, a restart by the agent is refused (``refuse``); a fresh
    launch (a person or a scheduler started the job again) starts over."""
    incidents = [i for i in incidents if i.get("cause") != ROLLBACK]
    if not incidents:
        return Remedy("restore", 0)
    newest = incidents[-1]
    if newest.get("cause") == RESTART_LOOP:
        return Remedy("restore", 0) if fresh_launch else Remedy("refuse", 0)
    if not policy.enabled or newest.get("cause") in (KILLED, GPU_CRITICAL):
        # A silent death (SIGKILL, the OOM killer, a lost node) is counted, but climbs
        # no ladder: its step is a heartbeat's guess and its cause may lie outside
        # the job, so skipping data or rewinding on it would be a guess too. A CRITICAL
        # GPU is the node's fault: the next attempt runs without it.
        return Remedy("restore", 1)
    sig = newest.get("signature")
    run: list[Mapping[str, Any]] = []
    for inc in reversed(incidents):
        if inc.get("cause") == RESTART_LOOP or inc.get("signature") != sig:
            break
        run.append(inc)
    tried = tuple(str((i.get("remedy") or {}).get("action")) for i in reversed(run[1:]))
    # A skip needs every rank's batch in flight: skipping on some ranks only would
    # put the ranks out of step.
    whole = len(newest.get("batches") or {}) == int(newest.get("world_before") or 1)
    ladder = [r for r in LADDER if r != "skip_batches" or whole]
    rung = len(run) - 1
    if rung >= min(policy.max_tries, len(ladder)):
        return Remedy("stop", len(run), tried)
    return Remedy(ladder[rung], len(run), tried)
