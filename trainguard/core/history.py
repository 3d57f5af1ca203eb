"""A run's history, derived from its checkpoint manifests alone: checkpoints over time,
restarts, rollbacks, world-size changes, save timing and the interval advice.

The manifests are the truth (no database of its own): the session record
(:mod:`trainguard.core.record`) gives each checkpoint's generation, commit and world
size, and its skipped batches (before record version 4; from then on the caller's
``skips`` reads them from the rank objects,
:func:`trainguard.core.rank_record.checkpoint_skipped`); the timing record (:mod:`trainguard.core.timing`) gives
save timings, restore/rollback events and the run's totals. Manifests of older
writers (no timing record) still give the timeline: a restart is then a generation
change, and the observed time the span of commit times.

Only the manifests a store keeps are seen: a retention that deleted old checkpoints
shortens the timeline, while the totals (carried from manifest to manifest) stay.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypedDict

from trainguard.core.checkpoints import ManifestView
from trainguard.core.interval import IntervalPolicy, advise
from trainguard.core.record import RecordError, SessionRecord
from trainguard.core.timing import SaveTime, TimingError, TimingRecord

__all__ = ["CheckpointRow", "RestartRow", "RunKey", "Skips", "WorldRow", "histories", "history",
           "run_keys", "with_recorded_failures"]

Skips = Callable[[ManifestView, SessionRecord], "tuple[str, ...] | None"]
"""A checkpoint's skipped batches from its manifest and session record."""


def _manifest_skips(m: ManifestView, rec: SessionRecord) -> tuple[str, ...] | None:
    return rec.skipped


@dataclass(frozen=True)
class RunKey:
    dataset: str
    run: str


def _record(m: ManifestView) -> SessionRecord | None:
    try:
        return SessionRecord.of(m)
    except RecordError:
        return None


def _timing(m: ManifestView) -> TimingRecord | None:
    try:
        return TimingRecord.from_extra(m.extra)
    except TimingError:
        return None


def run_keys(manifests: Iterable[ManifestView]) -> set[RunKey]:
    """The (dataset, run) pairs whose session records ``manifests`` carry."""
    out = set()
    for m in manifests:
        rec = _record(m)
        if rec is not None and rec.run:
            out.add(RunKey(rec.dataset, rec.run))
    return out


def histories(manifests: Iterable[ManifestView], *,
              policy: IntervalPolicy | None = None,
              skips: Skips | None = None) -> list[dict[str, Any]]:
    """The history of every run ``manifests`` carry, ordered by (run, dataset): one
    pass sorts the manifests by run, then each run's history reads only its own (a
    root of R runs and M manifests costs O(M), not O(R x M))."""
    by_run: dict[RunKey, list[ManifestView]] = {}
    for m in manifests:
        rec = _record(m)
        if rec is not None and rec.run:
            by_run.setdefault(RunKey(rec.dataset, rec.run), []).append(m)
    return [history(by_run[k], dataset=k.dataset, run=k.run, policy=policy, skips=skips)
            for k in sorted(by_run, key=lambda k: (k.run, k.dataset))]


def _created(m: ManifestView) -> float | None:
    value = getattr(m, "created_at", None)
    return None if value is None else float(value)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


class _CheckpointFields(TypedDict):
    step: int
    name: str
    created_at: float | None
    nbytes: int | None
    generation: int
    commit: int
    world_size: int
    num_workers: int
    pinned: bool
    blocked_s: float | None
    durable_s: float | None
    skipped: int


class CheckpointRow(_CheckpointFields, total=False):
    """One checkpoint of a run history (``checkpoints[]`` of ``GET /admin/runs/{group}``
    and ``trainguard runs show``). The OpenAPI schema is tested against these keys
    (test_document_shapes). ``NotRequired`` would do, but not under ``from __future__
    import annotations`` on Python 3.11 (it would count as required)."""

    status: list[str]
    """Added by the admin API from the store's labels (committed, pinned, remote...)."""
    tiers: list[str]
    """Added by the admin API: where it lives (ram, partner:n<r>, disk, remote)."""


class RestartRow(TypedDict):
    """A restart seen in the history (a newer generation's first manifest)."""

    at: float | None
    generation: int
    from_generation: int
    resumed_step: int
    first_step_after: int
    last_committed_step: int
    steps_redone: int
    steps_redone_exact: bool


class WorldRow(TypedDict):
    """A change of world size or workers per rank, at the first manifest with it."""

    at: float | None
    step: int
    world_size: int
    num_workers: int


def history(manifests: Iterable[ManifestView], *, dataset: str, run: str,
            policy: IntervalPolicy | None = None, failures: int | None = None,
            skips: Skips | None = None) -> dict[str, Any]:
    """The history of ``run`` on ``dataset`` from ``manifests`` (any order, any runs:
    the others are ignored), as JSON-ready data. ``skips``: each checkpoint's skipped
    batches (default: the manifest's own, which a version 4 record does not carry). ``failures``: the failed attempts
    Redis recorded (:mod:`trainguard.core.incidents`; those that died before their
    first checkpoint left no manifest): the failure count is at least that."""
    mine = []
    for m in manifests:
        rec = _record(m)
        if rec is not None and rec.run == run and rec.dataset == dataset:
            mine.append((m, rec, _timing(m)))
    mine.sort(key=lambda t: t[0].uid)  # commit order
    measured = {s.name: (s.blocked_s, s.durable_s) for s in _saves(mine) if s.name}
    checkpoints: list[CheckpointRow] = []
    restarts: list[RestartRow] = []
    rollbacks: list[dict[str, Any]] = []
    world: list[WorldRow] = []
    skipped_of = skips or _manifest_skips
    prev: tuple[ManifestView, SessionRecord] | None = None
    prev_skipped: tuple[str, ...] | None = None
    committed_by_gen: dict[int, int] = {}
    newest_gen: int | None = None
    for m, rec, tim in mine:
        blocked, durable = measured.get(m.name, (None, None))
        skipped = skipped_of(m, rec)
        checkpoints.append({
            "step": m.step, "name": m.name, "created_at": _created(m),
            "nbytes": getattr(m, "nbytes", None), "generation": rec.generation,
            "commit": rec.commit, "world_size": rec.world_size, "num_workers": rec.num_workers,
            "pinned": m.pinned, "blocked_s": blocked, "durable_s": durable,
            "skipped": len(skipped or ()),
        })
        events = tim.events if tim else ()
        # Against the newest generation seen, not the previous manifest's: a fenced
        # zombie's late commit (an older generation) is no restart, nor is the next
        # manifest of the generation it interrupted.
        if prev is not None and newest_gen is not None and rec.generation > newest_gen:
            restore = next((e for e in reversed(events) if e.kind == "restore"), None)
            resumed = restore.to_step if restore else _resumed_guess(mine, m, rec)
            old_max = committed_by_gen.get(newest_gen, prev[0].step)
            last = restore.last_step if restore else None
            restarts.append({
                "at": restore.at if restore else _created(m), "generation": rec.generation,
                "from_generation": newest_gen, "resumed_step": resumed,
                "first_step_after": m.step, "last_committed_step": old_max,
                "steps_redone": (last if last is not None else old_max) - resumed,
                "steps_redone_exact": last is not None,
            })
        for e in events:
            if e.kind == "rollback":
                rollbacks.append({"at": e.at, "to_step": e.to_step, "last_step": e.last_step,
                                  "generation": e.generation})
        if prev is not None and prev_skipped != skipped and rollbacks:
            before = set(prev_skipped or ())
            rollbacks[-1].setdefault("skipped", [b for b in skipped or () if b not in before])
        if prev is None or (prev[1].world_size, prev[1].num_workers) != (rec.world_size,
                                                                          rec.num_workers):
            world.append({"at": _created(m), "step": m.step, "world_size": rec.world_size,
                          "num_workers": rec.num_workers})
        committed_by_gen[rec.generation] = max(committed_by_gen.get(rec.generation, 0), m.step)
        newest_gen = max(rec.generation, newest_gen or 0)
        prev, prev_skipped = (m, rec), skipped
    for rb in rollbacks:
        rb.setdefault("skipped", [])
    return {
        "dataset": dataset, "run": run, "checkpoints": checkpoints, "restarts": restarts,
        "rollbacks": rollbacks, "world": world,
        **_advice(mine, restarts, policy, failures or 0),
    }


def _saves(mine: list[tuple[ManifestView, SessionRecord, TimingRecord | None]]
           ) -> list[SaveTime]:
    """Every measured save once. Manifests repeat the last few, the earlier copies
    before the save was durable (no name, no durable time): a measurement is one
    (step, blocked_s), and its most complete copy wins."""
    out: dict[tuple[int, float], SaveTime] = {}
    for _, _, tim in mine:
        for s in tim.saves if tim else ():
            old = out.get((s.step, s.blocked_s))
            if old is None or (old.durable_s is None and s.durable_s is not None):
                out[(s.step, s.blocked_s)] = s
    return list(out.values())


def _resumed_guess(mine: list[tuple[ManifestView, SessionRecord, TimingRecord | None]],
                   m: ManifestView, rec: SessionRecord) -> int:
    """Without a restore event: the newest earlier checkpoint of an older generation
    (what the restore order picks), else 0."""
    older = [(r.generation, r.commit, x.uid, x.step) for x, r, _ in mine
             if x.uid < m.uid and r.generation < rec.generation]
    return max(older)[3] if older else 0


def _advice(mine: list[tuple[ManifestView, SessionRecord, TimingRecord | None]],
            restarts: list[RestartRow], policy: IntervalPolicy | None,
            recorded: int) -> dict[str, Any]:
    timed = [t for _, _, t in mine if t is not None]
    saves = _saves(mine)
    blocked = _median([s.blocked_s for s in saves])
    durable = _median([s.durable_s for s in saves if s.durable_s is not None])
    current = _median([t.interval_s for t in timed[-SAVES_WINDOW:] if t.interval_s is not None])
    if timed:
        failures, observed = timed[-1].totals.restarts, timed[-1].totals.trained_s
    else:
        times = [c for c in (_created(m) for m, _, _ in mine) if c is not None]
        failures, observed = len(restarts), (max(times) - min(times)) if times else 0.0
    failures = max(failures, recorded)
    totals = {"failures": failures, "observed_s": observed,
              "rollbacks": timed[-1].totals.rollbacks if timed else None}
    if blocked is None:
        return {"totals": totals, "advice": None}
    advice = advise(blocked_s=blocked, durable_s=durable if durable is not None else blocked,
                    observed_s=observed, failures=failures, current_s=current, policy=policy)
    return {"totals": totals, "advice": advice.to_json()}


SAVES_WINDOW = 8
"""How many recent manifests' intervals make "the current interval" (their median)."""


def with_recorded_failures(h: dict[str, Any], failures: int,
                           policy: IntervalPolicy | None = None) -> dict[str, Any]:
    """``h``'s ``totals`` and ``advice`` with at least ``failures`` failures (the
    failed attempts Redis recorded, :mod:`trainguard.core.incidents`: those that died
    before their first checkpoint left no manifest). ``h`` itself is left as it is."""
    totals = dict(h["totals"])
    if failures <= int(totals.get("failures") or 0):
        return {"totals": totals, "advice": h["advice"]}
    totals["failures"] = failures
    a = h["advice"]
    if a is None:
        return {"totals": totals, "advice": None}
    advice = advise(blocked_s=a["blocked_s"], durable_s=a["durable_s"],
                    observed_s=a["observed_s"], failures=failures, current_s=a["current_s"],
                    policy=policy)
    return {"totals": totals, "advice": advice.to_json()}
