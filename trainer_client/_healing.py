"""What a session does so that its job heals itself: the attempt record and the
restart-loop breaker's remedy (:mod:`trainer_client._attempts`), the watchdog
(:mod:`trainer_client.watchdog`), the collective timeout, and the loop's own count of
steps and records that they read.

Kept apart from ``session.py``, which calls it at a few points: made in the
constructor (registers the attempt), ``restoring``/``restored`` around a restore,
``handing`` for each batch ``batches`` is about to hand the loop, ``phase`` around
restores and checkpoints, ``skipped`` when a checkpoint writes its skipped batches,
``closed``/``close``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer_client._attempts import AttemptLog
from trainer_client._batch_ids import batch_id, overlaps
from trainer_client.batch import Batch
from trainer_client.watchdog import Watchdog, WatchdogConfig, silent_peers
from trainguard.core import settings
from trainguard.core.incidents import LoopPolicy

__all__ = ["Healing"]

log = logging.getLogger("trainer_client.session")


def _config(watchdog: WatchdogConfig | bool | None) -> WatchdogConfig:
    if isinstance(watchdog, WatchdogConfig):
        return watchdog
    return WatchdogConfig(enabled=False) if watchdog is False else WatchdogConfig.from_env()


def _policy(breaker: LoopPolicy | bool | None) -> LoopPolicy:
    if isinstance(breaker, LoopPolicy):
        return breaker
    return LoopPolicy(enabled=False) if breaker is False else LoopPolicy.from_env(
        settings.loop_breaker())


class Healing:
    """One session's watchdog, attempt record and breaker remedy (see the module)."""

    def __init__(self, redis_url: str, *, dataset: str, run: str, rank: int, world_size: int,
                 call: Callable[..., Any], broadcast: Callable[[Any], Any],
                 process_group: Any, watchdog: WatchdogConfig | bool | None,
                 loop_breaker: LoopPolicy | bool | None) -> None:
        cfg = _config(watchdog)
        self.world_size, self.process_group = world_size, process_group
        self.attempts = AttemptLog(redis_url, dataset=dataset, run=run, rank=rank,
                                   world_size=world_size, call=call, broadcast=broadcast,
                                   policy=_policy(loop_breaker))
        try:
            self.attempts.start()
        except BaseException:
            self.attempts.close()
            raise
        extra = {"heartbeat_s": cfg.heartbeat_s, "kill_stalled_peers": cfg.kill_stalled_peers}
        # Two checkers of the peers' heartbeats, not every rank: a read of W beats a
        # second by each of W ranks would be O(W^2) at scale.
        def peers(silence_s: float) -> list[int]:
            return silent_peers(self.attempts.beats(), rank=rank,
                                attempt=self.attempts.attempt, silence_s=silence_s)

        self.watchdog = Watchdog(cfg, beat=self.attempts.heartbeat,
                                 fire=lambda rep: self.attempts.hang({**rep, **extra}),
                                 peers=peers if rank < 2 and world_size > 1 else None)
        wd = self.watchdog
        self.attempts.step_of = lambda: (wd.step, wd.batch, wd.phase_name)
        self._pg_timeout_s: float | None = None
        self._step = 0  # restored step + batches handed out: the step in flight
        self._records = 0
        self._handed = 0
        self._catch_up: int | None = None  # the failed step, until the loop is back there
        self._skips: list[str] = []  # skipped batches, carried into every manifest
        self._skip_ids: set[str] = set()  # the breaker's: batches to skip on sight

    @property
    def failures(self) -> int:
        return self.attempts.failures

    def phase(self, name: str, limit_s: float | None = None
              ) -> contextlib.AbstractContextManager[None]:
        return self.watchdog.phase(name, limit_s)

    def collective_timeout(self) -> timedelta:
        return timedelta(seconds=self.watchdog.collective_timeout_s())

    def retime(self) -> None:
        """Set the process group's timeout to the watchdog's figure when it moved by a
        quarter. Called on the main thread between collectives, never under one."""
        if self.world_size == 1 or not self.watchdog.config.enabled:
            return
        seconds = self.watchdog.collective_timeout_s()
        old = self._pg_timeout_s
        if old is None or abs(seconds - old) > 0.25 * old:
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds),
                                                  self.process_group)
            self._pg_timeout_s = seconds

    # ------------------------------------------------------------------ restore

    def restoring(self) -> bool:
        """Before a restore: raise RestartLoopError when the breaker stops the run;
        True when the restore must skip the newest checkpoint."""
        self.attempts.stop_if_looping()
        self.retime()
        return self.attempts.remedy.action == "older_checkpoint"

    def restored(self, step: int, skips: Sequence[str] | None, generation: int | None) -> None:
        """After a restore to ``step``: ``skips``, the skipped batches this rank carries
        on from the checkpoint (its own; the run's from a manifest before record 4)."""
        self._step, self._records, self._handed = step, 0, 0
        failed = (self.attempts.incident or {}).get("step")
        self._catch_up = failed if failed is not None and failed > step else None
        self._skips = list(skips or ())
        skip = self.attempts.skipped_batch()
        if skip is not None:
            log.warning("restart-loop breaker: the same failure came back at step %s with "
                        "batch %s in flight: skipping it (consumed, never trained, listed in "
                        "the manifests' skipped batches)", failed, skip)
            self._skip_ids.add(skip)
        self.watchdog.step = step
        self.attempts.restored(step, generation)
        self.watchdog.enter("startup")

    def rolled_back(self, step: int, reason: str | None) -> None:
        """A rollback went back to ``step``: an incident; the loop counts on from there."""
        self.attempts.rolled_back(from_step=self._step, to_step=step, reason=reason)
        self._step = step
        self.watchdog.step = step

    @property
    def step(self) -> int:
        """The loop's step: the restored one plus the batches handed since."""
        return self._step

    # ------------------------------------------------------------------ the loop

    def handing(self, batch: Batch) -> bool:
        """The loop asks for its next batch, so the step before ended. False: the
        breaker skips this batch (its offsets are consumed; its ID goes into the
        manifests' skipped batches)."""
        bid = batch_id(batch) if batch.ids else None
        if bid is not None and any(overlaps(bid, s) for s in self._skip_ids):
            if bid not in self._skips:
                self._skips.append(bid)
            return False
        self._handed += 1
        self._step += 1
        self._records += len(batch)
        self.watchdog.progress(self._step, bid, self._records)
        if self._handed == 2:
            self.attempts.first_step()
        if self._catch_up is not None and self._step >= self._catch_up:
            # Every rank is at this loop step together (batches() keeps them in step):
            # count the records all of them trained again up to the failed step.
            self._catch_up = None
            counts = [self._records]
            if self.world_size > 1:
                counts = [0] * self.world_size
                dist.all_gather_object(counts, self._records, group=self.process_group)
            self.attempts.caught_up(sum(counts))
        self.retime()
        return True

    def loop_ended(self) -> None:
        self.attempts.first_step()
        self.watchdog.enter("idle")

    def skipped(self, given: Sequence[str] | None) -> Sequence[str] | None:
        """The skipped batches a checkpoint records: the run's so far and ``given``."""
        if not self._skips:
            return given
        return [*self._skips, *(b for b in given or () if b not in self._skips)]

    # ------------------------------------------------------------------ the end

    def closed(self) -> None:
        self.attempts.closed()

    def close(self) -> None:
        self.watchdog.stop()
        self.attempts.close()
