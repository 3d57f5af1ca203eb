"""What the run page says about training itself: the loss and other values the loop
reported (``session.log``, :mod:`trainguard.core.trainlog`), steps/s, the ETA, and a
heartbeat that turns red when the trainer stops making progress.

The heartbeat is the newest sign of progress: the loop's last report, or a rank's
watchdog beat's ``progress_at`` (the last step, :mod:`trainer_client.watchdog`),
whichever is newer. A trainer whose threads are alive but whose loop is stuck stops
both, so a hung run reads "stalled", never "training".
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis

from trainguard.core import incidents as inc
from trainguard.core import trainlog

__all__ = ["POINTS", "STALLED_AFTER_S", "training"]

POINTS = 600
"""Newest trainlog entries the run page draws (about ten minutes at one a second)."""
STALLED_AFTER_S = 15.0
"""Least silence that reads as stalled: a few missed reports, not one slow step."""
RATE_WINDOW_S = 60.0
"""Steps/s is measured over the newest this many seconds of one attempt's reports."""


def _rate(points: list[dict[str, Any]]) -> float | None:
    """Steps per second over the newest window of the newest attempt's reports."""
    if len(points) < 2:
        return None
    newest = points[-1]
    window = [p for p in points if p.get("attempt") == newest.get("attempt")
              and float(newest["at"]) - float(p["at"]) <= RATE_WINDOW_S]
    first = window[0]
    dt = float(newest["at"]) - float(first["at"])
    if dt <= 0 or int(newest["step"]) <= int(first["step"]):
        return None
    return (int(newest["step"]) - int(first["step"])) / dt


def _heartbeat(points: list[dict[str, Any]], beats: list[dict[str, Any]],
               attempts: list[dict[str, Any]], rate: float | None,
               now: float) -> dict[str, Any]:
    last = max([float(p["at"]) for p in points[-1:]]
               + [float(b["progress_at"]) for b in beats if b.get("progress_at")], default=None)
    every = max([float(b.get("every_s") or 0.0) for b in beats], default=0.0)
    limit = max(STALLED_AFTER_S, 3 * every, 3 / rate if rate else 0.0)
    outcome = attempts[-1].get("outcome") if attempts else None
    age = None if last is None else max(0.0, now - last)
    if outcome == "ok":
        status, advice = "finished", "the trainer ended its run and closed its session"
    elif outcome == "failed":
        status, advice = "failed", ("the trainer's last attempt failed: the Incidents card "
                                    "says why; a restarted trainer resumes from the newest "
                                    "checkpoint")
    elif last is None:
        status, advice = "unknown", ("no report from the trainer yet: call session.log("
                                     "loss=...) in the loop to see its loss and progress here")
    elif age is not None and age <= limit:
        status, advice = "training", "the trainer is making progress"
    else:
        status, advice = "stalled", (
            f"no progress from the trainer for {age:.0f} s (it reports about every "
            f"{max(trainlog.INTERVAL_S, every):.0f} s while it trains): it is stopped or "
            "hung; check its process, and `trainguard runs show` for its stacks")
    return {"status": status, "last_progress_at": last, "age_s": age, "limit_s": limit,
            "advice": advice}


async def training(r: aioredis.Redis, dataset: str, run: str,
                   attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The run page's training card, from Redis (``attempts``: the run's attempt
    documents, oldest first)."""
    rows = await r.xrevrange(trainlog.trainlog_key(dataset, run), count=POINTS) or []
    points = [d for d in (trainlog.decode(fields or {}) for _, fields in reversed(rows))
              if d is not None and d.get("at") is not None and d.get("step") is not None]
    beats = [d for d in inc.documents(await r.hgetall(inc.alive_key(dataset, run))).values()]
    rate = _rate(points)
    newest = points[-1] if points else None
    left = newest.get("steps_left") if newest else None
    return {
        "points": [{"at": p["at"], "step": p["step"], "values": p.get("values") or {}}
                   for p in points],
        "step": newest["step"] if newest else None,
        "values": (newest.get("values") or {}) if newest else {},
        "steps_per_s": rate,
        "steps_left": left,
        "eta_s": None if left is None or not rate else left / rate,
        "heartbeat": _heartbeat(points, beats, attempts, rate, time.time()),
    }
