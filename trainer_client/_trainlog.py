"""``session.log``'s writer: the newest values of rank 0's loop into the run's capped
trainlog stream (:mod:`trainguard.core.trainlog`), at most one entry a second."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from trainguard.core import trainlog

__all__ = ["TrainLog"]


class TrainLog:
    """One session's trainlog writer. ``steps_left`` is asked only when an entry is
    written (it reads Redis), not on every ``log``."""

    def __init__(self, client: redis.Redis, call: Callable[..., Any], *, dataset: str,
                 run: str, rank: int, steps_left: Callable[[], int | None]) -> None:
        self._client = client
        self._call = call
        self._key = trainlog.trainlog_key(dataset, run)
        self._rank = rank
        self._steps_left = steps_left
        self._last_write = float("-inf")
        self._pending: dict[str, Any] | None = None

    def log(self, step: int, values: Mapping[str, Any], attempt: int | None) -> None:
        checked = trainlog.check_values(values)
        if self._rank != 0:
            return  # rank 0's loss stands for the run (DDP's losses agree after the step)
        now = time.time()
        pending = self._pending
        if pending is not None and pending["step"] == int(step):
            # Several logs of one step (a framework's loss, then its summary) make one entry.
            checked = {**pending["values"], **checked}
        self._pending = {"attempt": attempt, "rank": self._rank, "step": int(step), "at": now,
                         "values": checked}
        if now - self._last_write >= trainlog.INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Write the pending entry now (also at the session's close: the last values)."""
        doc, self._pending = self._pending, None
        if doc is None:
            return
        self._last_write = time.time()
        doc["values"] = trainlog.as_floats(doc["values"])
        doc["steps_left"] = self._steps_left()
        self._call(self._client.xadd, self._key, trainlog.encode(doc),
                   maxlen=trainlog.KEPT, approximate=True)
