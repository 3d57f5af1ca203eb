"""A session's checkpoint path: the offsets and random states captured with the
state, the session record, the fence check, the save (per-rank state objects or one
gather), then the committer acknowledges and publishes; and the interval advisor's
answers (:class:`Checkpointing`, a part of ``TrainingSession``)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainer_client import _rng
from trainer_client import offsets as ofs
from trainer_client._checks import check_not_bypassed, warn_divergent
from trainer_client._commit import gather_offsets
from trainer_client._consumed import Snapshot
from trainer_client._finished import FinishedHandle
from trainer_client._loaders import refuse_own_position
from trainer_client._session_base import SessionBase
from trainer_client.errors import FencedError
from trainguard.core import record
from trainguard.core.checkpoints import (
    SaveHandleView,
)
from trainguard.core.interval import Advice
from trainguard.core.rank_record import RankRecord
from trainguard.core.record import RECORD_VERSION, RankState, SessionRecord
from trainguard.core.tier_plan import TIERS_KEY, TierPlan
from trainguard.core.timing import TIMING_KEY

__all__ = ["Checkpointing"]


class Checkpointing(SessionBase):
    """The checkpoint path of a ``TrainingSession``."""

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(
        self,
        state: Any,
        step: int,
        *,
        blocking: bool = False,
        extra: Mapping[str, Any] | None = None,
        skipped: Sequence[str] | None = None,
    ) -> SaveHandleView:
        """Save ``state`` with the offsets consumed so far; returns the store's handle.

        The offsets and this rank's random states are captured now, together with the
        state the store stages now. With several ranks this is a collective (call it
        on every rank at the same step), and state values that are not ``Shard``
        blocks are saved from rank 0: a warning names those that differ across
        ranks. Refused with :class:`SessionBypassedError` when the loop read data
        without ever iterating :meth:`batches` (the offsets would be wrong).
        After the manifest commits (in the store's background thread unless
        ``blocking``), entries up to them are acknowledged and the committed offsets
        and the retention floor are published. A fenced trainer commits nothing: with
        a store of per-rank objects its fences are checked in the save's background
        writer before the commit (the returned handle fails with
        :class:`FencedError`, and so does the session's next call; with ``blocking``
        this call raises it), with other stores here, before the save. ``skipped`` lists
        the batches consumed but never trained by this rank (its state object carries
        them; with a store without per-rank objects, rank 0's go into the manifest).
        A session restored at the end of a finished dataset (:attr:`finished`) writes
        nothing and returns the restored checkpoint's handle.
        """
        for key in (record.RECORD_KEY, record.SKIPPED_KEY, TIMING_KEY, TIERS_KEY):
            if extra is not None and key in extra:
                raise ValueError(f"extra must not use the key {key!r}: the session writes it")
        refuse_own_position(state)
        self._committer.raise_background()
        gen = self._gen()
        if self._finished is not None:
            # A rerun of a finished run: the restored checkpoint already holds it all,
            # and a second one of the same step would only repeat it.
            return FinishedHandle(self._finished)
        if self._rank_store is None:
            # A store without per-rank objects has no precommit step: the check stays
            # on the loop's path, before the save.
            self._check_fence(gen)
        self._place(self._mine(self._num_workers))
        now = self._consumed.snapshot()
        offsets = now.offsets
        mine = RankState(rng=_rng.capture(), epoch=now.epoch, epoch_batches=now.epoch_batches)
        if now.passes == 0:
            owned = sorted(p for ps in self._owned(self._num_workers).values() for p in ps)
            self._call(check_not_bypassed, self._redis, self.dataset_name, self.run,
                       {p: offsets[p] for p in owned})
        with self._heal.phase("checkpoint"):
            self._heal.retime()
            handle = self._save(state, step, now, mine, blocking=blocking, extra=extra,
                                skipped=self._heal.skipped(skipped))
        self._heal.retime()
        return handle

    def _save(self, state: Any, step: int, now: Snapshot, mine: RankState, *, blocking: bool,
              extra: Mapping[str, Any] | None, skipped: Sequence[str] | None) -> SaveHandleView:
        gen = self._gen()
        if self.world_size > 1 and isinstance(state, Mapping):
            warn_divergent(state, self.process_group)
        self._commits += 1
        per_rank = self._rank_store is not None
        offsets, batches, ranks = now.offsets, now.batches, {self.rank: mine}
        if not per_rank and self.world_size > 1:
            offsets, batches, ranks = gather_offsets(offsets, batches, mine, self.world_size,
                                                     self.process_group)
        rec = SessionRecord(
            dataset=self.dataset_name,
            run=self.run,
            partitions=self.spec.partitions,
            generation=gen,
            commit=self._commits,
            world_size=self.world_size,
            num_workers=self._num_workers,
            offsets={} if per_rank else offsets,
            batches={} if per_rank else batches,
            # With per-rank objects each rank's own skips go into its object.
            skipped=None if skipped is None or per_rank else tuple(skipped),
            seed=self.seed,
            ranks={} if per_rank else ranks,
            version=RECORD_VERSION if per_rank else 2,
        )
        doc = {**(extra or {}), **rec.to_extra(), **self._clock.extra(step), **self._every.extra()}
        started = time.monotonic()
        if self._rank_store is not None:
            parts = self._mine(self._num_workers)
            own = RankRecord(rank=self.rank, world_size=self.world_size,
                             num_workers=self._num_workers,
                             offsets={p: now.offsets[p] for p in parts},
                             batches={p: now.batches[p] for p in parts}, state=mine,
                             skipped=None if skipped is None else tuple(skipped))
            # The fence check runs in the store's writer before this rank reports its
            # save to rank 0, not here: the loop goes on after the in-memory capture,
            # and a fenced rank still fails the save on every rank, nothing committed
            # (a zombie's manifest is what the check keeps out; the loop's steps are
            # the zombie's own business). It is also later, so a restore racing the
            # save is caught more often (restore_order covers the rest).
            handle = self._rank_store.save(state, step=step, extra=doc, blocking=blocking,
                                           rank_state=own.to_wire(),
                                           precommit=lambda: self._check_fence(gen))
            self._clock.saved(handle, step, started)
            # Every rank acknowledges and publishes its own partitions.
            self._committer.after(handle, own.offsets, gen, blocking=blocking, rec=rec, own=own)
            return handle
        handle = self.store.save(state, step=step, extra=doc, blocking=blocking)
        self._clock.saved(handle, step, started)
        if self.rank == 0:
            self._committer.after(handle, offsets, gen, blocking=blocking, rec=rec)
        return handle

    def _check_fence(self, gen: int) -> None:
        """FencedError when a newer generation took the run over: checked on this
        rank's partitions with per-rank objects (a restore bumps every partition's
        fence, so each rank finds out on its own), else on every partition."""
        parts = self._mine(self._num_workers) if self._rank_store is not None else None
        current = max(
            self._call(
                ofs.current_generations, self._redis, self.dataset_name, self.run,
                self.spec.partitions if parts is None else parts,
            ),
            default=0,
        )
        if current > gen:
            raise FencedError(group=self.run, mine=gen, current=current, what="checkpoint")

    def should_checkpoint(self, step: int) -> bool:
        """Whether to checkpoint now, as ``checkpoint_every`` says
        (:mod:`trainer_client._every`): every n-th step; by default (None) once the
        loop has trained the interval the advisor recommends
        (:meth:`checkpoint_advice`) since the last save or restore; with ``"auto"``
        over a store of several tiers, at the first tier's period of the multi-level
        plan (:meth:`checkpoint_plan`), whose copy intervals the store then follows.
        Call it every step with the step reached; it reads a clock, nothing remote.
        With ``world_size > 1`` every rank calls it (rank 0's answer and plan are
        broadcast, so all ranks checkpoint together and copy alike)."""
        due, every = self._every.decide(step)
        if self.world_size > 1 and not isinstance(self._every.mode, int):
            due, every = self._broadcast((due, every))
        if due:
            self._every.follow(every)
        return bool(due)

    def checkpoint_plan(self) -> TierPlan | None:
        """With ``checkpoint_every="auto"`` over a store of several tiers, the plan of
        the last :meth:`should_checkpoint` (each tier's period, copy interval, cost and
        failure rate: :mod:`trainguard.core.tier_plan`); None before one or otherwise."""
        return self._every.plan

    def checkpoint_advice(self) -> Advice | None:
        """The recommended interval (Young/Daly, :mod:`trainguard.core.interval`)
        from this run's measured save times and restart history (carried over
        restores in the manifests); None before a save was measured."""
        return self._clock.advice()

