"""Whether a restored run has nothing left: every partition of a finished dataset
consumed to its end. Such a session trains nothing and writes nothing (a rerun of a
finished run must not add a second checkpoint of the same step)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import redis

from trainguard.core import streams
from trainguard.core.checkpoints import ManifestView

__all__ = ["FinishedHandle", "consumed_to_the_end", "ends_if_finished"]


def ends_if_finished(client: redis.Redis, dataset: str,
                     partitions: int) -> dict[int, str] | None:
    """Each partition's last ID (``end:<p>``; left out: it got no record) once the
    producer has finished ``dataset``; None while more may come (endless, or still
    being produced). One HGETALL: a restore asks it before reading any position."""
    prog = client.hgetall(streams.progress_key(dataset))
    if prog.get(streams.PROGRESS_FINISHED) != b"1":
        return None
    ends = {}
    for p in range(partitions):
        end = prog.get(streams.progress_end_field(p))
        if end is not None:
            ends[p] = end.decode() if isinstance(end, bytes) else str(end)
    return ends


def consumed_to_the_end(ends: Mapping[int, str], offsets: Mapping[int, str]) -> bool:
    """True when every partition's offset is at (or past) its last ID."""
    return all(streams.parse_id(offsets.get(p, streams.ZERO_ID)) >= streams.parse_id(end)
               for p, end in ends.items())


class FinishedHandle:
    """What ``checkpoint`` returns for a finished run: the restored checkpoint itself,
    already committed (nothing was saved, so nothing is pending)."""

    def __init__(self, manifest: ManifestView) -> None:
        self._manifest = manifest

    @property
    def step(self) -> int:
        return int(self._manifest.step)

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> ManifestView:
        return self._manifest

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

