"""A run's restarts from its recorded attempts, so the Restarts card agrees with the
restart count after a retention pruned the manifests that showed them.

The manifests show a restart as a generation change between two kept checkpoints
(:func:`trainguard.core.history.history`); once retention deleted the first
checkpoint of a generation, that change is gone, while the totals carried from
manifest to manifest (and the failures Redis recorded) still count it. Redis keeps
every attempt (:mod:`trainguard.core.incidents`): a failure's incident names the
failed attempt, and the attempt after it says which generation it took and which
step it restored. Those are the restarts; the manifests' rows add what only they
know (the last committed step before, the first step after).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainguard.core import incidents as inc

__all__ = ["merged_restarts"]


def merged_restarts(from_manifests: Sequence[dict[str, Any]], attempts: Sequence[dict[str, Any]],
                    incidents: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifests' restarts, each with the failure that caused it when Redis has
    it, plus one row per recorded restart the kept manifests no longer show
    (``"seen_in": "attempts"``), in generation order. The inputs are left as they are."""
    by_attempt = {int(a.get("attempt") or 0): a for a in attempts}
    rows = {int(x["generation"]): {**x, "seen_in": "manifests"} for x in from_manifests}
    for incident in incidents:
        if incident.get("cause") in inc.NOT_FAILURES:
            continue
        failed = int(incident.get("attempt") or 0)
        after = by_attempt.get(failed + 1)
        if after is None or after.get("restored_at") is None or after.get("generation") is None:
            continue  # the next attempt has not restored yet
        gen = int(after["generation"])
        recovery = incident.get("recovery") or {}
        known = {"cause": incident.get("cause"), "attempt": failed + 1}
        if gen in rows:
            rows[gen] = {**rows[gen], **known}
            continue
        redone = recovery.get("steps_redone")
        rows[gen] = {
            "at": after["restored_at"], "generation": gen, "from_generation": None,
            "resumed_step": after.get("restored_step"), "first_step_after": None,
            "last_committed_step": None, "failed_step": incident.get("step"),
            "steps_redone": redone, "steps_redone_exact": redone is not None,
            "seen_in": "attempts", **known,
        }
    return [rows[g] for g in sorted(rows)]
