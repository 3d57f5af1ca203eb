"""How an incident's time to the next step is split: detect, then either one
``restart`` phase or, when the attempt knows when its rendezvous round closed (the
trainguard backend sets ``TRAINGUARD_RDZV_CLOSED_AT`` for the workers it spawns),
``rendezvous`` and ``spawn``; a closure time older than the failure belongs to an
earlier round (an inherited environment) and is not used. The phases add up to the
total."""

from __future__ import annotations

import pytest

from trainguard.core import incidents as inc

INCIDENT = {"failed_at": 100.0, "detected_at": 102.0, "step": 9}
ATTEMPT = {"started_at": 106.0, "imported_at": 107.0, "session_at": 107.5,
           "restored_at": 108.0, "first_step_at": 108.25, "restored_step": 5}


@pytest.mark.parametrize(("closed", "want"), [
    (None, {"detect": 2.0, "restart": 4.0}),
    (104.5, {"detect": 2.0, "rendezvous": 2.5, "spawn": 1.5}),
    (40.0, {"detect": 2.0, "restart": 4.0}),  # a stale value from an earlier round
])
def test_phases_from_failure_to_first_step(closed: float | None, want: dict[str, float]) -> None:
    attempt = {**ATTEMPT, **({} if closed is None else {"rendezvous_at": closed})}
    phases = inc.recovery(INCIDENT, attempt)["phases_s"]
    assert phases == {**want, "imports": 1.0, "session": 0.5, "restore": 0.5,
                      "first_step": 0.25}
    assert sum(phases.values()) == 108.25 - 100.0
