"""A session's restore path: what a restore may resume from (the session record of
a checkpoint, checked against this run: dataset, run, partition count), the refusals
rank 0 sends to every rank, and ``restore``, ``rollback`` and ``inspect`` themselves
(:class:`Restoring`, a part of ``TrainingSession``)."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from trainer_client import _rng
from trainer_client import offsets as ofs
from trainer_client._finished import consumed_to_the_end, ends_if_finished
from trainer_client._loaders import refuse_own_position
from trainer_client._session_base import SessionBase
from trainer_client._uneven import flag_device
from trainer_client.errors import (
    CheckpointMismatchError,
    FencedError,
    NoRollbackTargetError,
    PartitionCountError,
    TrainerClientError,
)
from trainguard.core import record, streams
from trainguard.core.checkpoints import (
    CheckpointStoreAPI,
    CorruptCheckpointError,
    ManifestView,
    open_store,
)
from trainguard.core.rank_record import carried_skips
from trainguard.core.record import (
    PER_RANK_VERSION,
    SKIPS_PER_RANK_VERSION,
    RankState,
    SessionRecord,
)

__all__ = ["REFUSALS", "Restoring", "check_record", "warn_if_reshaped"]

log = logging.getLogger("trainer_client.session")

REFUSALS: dict[str, type[Exception]] = {
    "CheckpointMismatchError": CheckpointMismatchError,
    "PartitionCountError": PartitionCountError,
    "LookupError": LookupError,
}


def check_record(manifest: ManifestView, *, dataset: str, run: str,
                 partitions: int) -> SessionRecord:
    """The session record of ``manifest``, or a clear error when this run cannot
    resume from it."""
    step = manifest.step
    try:
        rec = SessionRecord.of(manifest)
    except record.RecordError as exc:
        raise CheckpointMismatchError(f"checkpoint of step {step}: {exc}") from exc
    if rec is None:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} has no trainguard offsets in its manifest: "
            "expected one written by TrainingSession.checkpoint; use another store URL"
        )
    if rec.dataset != dataset or rec.run != run:
        raise CheckpointMismatchError(
            f"checkpoint of step {step} belongs to dataset {rec.dataset!r} run "
            f"{rec.run!r}, expected dataset {dataset!r} run {run!r}: "
            "use a separate checkpoint URL per run"
        )
    if rec.partitions != partitions:
        raise PartitionCountError(
            f"checkpoint of step {step} was written for {rec.partitions} "
            f"partitions, dataset {dataset!r} now has {partitions}: "
            "its offsets cannot be mapped; recreate the dataset with the old count or "
            "start a new run"
        )
    return rec


def warn_if_reshaped(rec: SessionRecord | None, world_size: int, num_workers: int) -> None:
    if rec is not None and (rec.world_size, rec.num_workers) != (world_size, num_workers):
        log.warning(
            "deterministic mode resumes a checkpoint written with world_size=%s "
            "num_workers=%s on world_size=%s num_workers=%s: every record is still read "
            "once, but the batch order differs from an uninterrupted run's",
            rec.world_size, rec.num_workers, world_size, num_workers,
        )


class Restoring(SessionBase):
    """The restore, rollback and inspect of a ``TrainingSession``."""

    def _load(self, state: Any, to_step: int | None, *,
              skip_newest: bool = False) -> ManifestView | None:
        """Load the newest valid manifest (or ``to_step``) into ``state`` in place.

        Rank 0 chooses the candidates (newest first) and every rank tries them in that
        order; a damaged checkpoint is skipped for the previous one. Refusals found by
        rank 0 are raised on every rank (no rank is left waiting in a collective)."""
        plan: dict[str, Any] = {"steps": []}
        if self.rank == 0:
            try:
                cands = [m for m in self.checkpoints() if to_step is None or m.step == to_step]
                if to_step is not None and not cands:
                    raise LookupError(f"no checkpoint of step {to_step} for run {self.run!r}")
                if skip_newest and len(cands) > 1:
                    log.warning("restart-loop breaker: the failure recurred after restoring "
                                "step %s: restoring the checkpoint before it, step %s",
                                cands[0].step, cands[1].step)
                    cands = cands[1:]
                if cands:
                    self._check(cands[0])
                plan = {"steps": [int(m.step) for m in cands]}
            except (TrainerClientError, LookupError) as exc:
                plan = {"error": type(exc).__name__, "message": str(exc)}
        plan = self._broadcast(plan)
        if "error" in plan:
            cls = REFUSALS.get(plan["error"], LookupError)
            raise cls(plan["message"])
        damaged: Exception | None = None
        for step in plan["steps"]:
            try:
                manifest = self.store.load(state, step=step)
            except CorruptCheckpointError as exc:
                log.warning("checkpoint of step %s is damaged (%s); trying the previous one", step, exc)
                damaged = exc
                continue
            assert manifest is not None  # a load of an explicit step raises instead
            self._check(manifest)
            return manifest
        if damaged is not None:
            # Starting over would silently throw the run away: let a person decide.
            raise damaged
        return None

    def _check(self, m: ManifestView) -> SessionRecord:
        return check_record(m, dataset=self.dataset_name, run=self.run,
                            partitions=self.spec.partitions)

    def restore(self, state: Any) -> int:
        """Load the newest valid checkpoint into ``state`` (in place), set this rank's
        random states to the ones saved with it, and move the run's consumer group to
        its offsets; returns its step (0 with no checkpoint: then every partition is
        read from its start and the random states are left as they are).

        Takes a new fencing generation first, so any older trainer of this run is
        refused from here on; acknowledges pending entries at or below the offsets
        (committed) and leaves those after them to be delivered again. To look at a
        checkpoint without taking the run over, use :meth:`inspect`.
        """
        refuse_own_position(state)
        self._committer.raise_background()
        with self._heal.phase("restore"):
            older = self._heal.restoring()
            manifest = self._load(state, None, skip_newest=older)
            rec = self._record(manifest)
            self._apply_offsets(manifest, rec, new_generation=True)
        self._clock.restored(manifest, self.generation)
        self._every.restored(manifest)
        self._clock.count_failures(self._heal.failures)
        step = int(manifest.step) if manifest is not None else 0
        self._heal.restored(step, self._restored_skips(manifest, rec), self.generation)
        self._finished = self._at_the_end(manifest, rec)
        self._log_restored(manifest)
        return step

    def _at_the_end(self, manifest: ManifestView | None,
                    rec: SessionRecord | None) -> ManifestView | None:
        """``manifest`` when it consumed every partition of a finished dataset to its
        end (rank 0 reads every partition's position, so all ranks agree)."""
        done = False
        if self.rank == 0 and manifest is not None and rec is not None:
            ends = self._call(ends_if_finished, self._redis, self.dataset_name,
                              self.spec.partitions)
            if ends is not None:
                # Only a finished dataset's restore reads every rank's positions.
                offsets = self._positions.positions(manifest, rec, sorted(ends)).offsets
                done = consumed_to_the_end(ends, offsets)
        return manifest if self._broadcast(done) else None

    @property
    def finished(self) -> bool:
        """True when the restored checkpoint had already trained every record of a
        finished dataset: :meth:`batches` yields nothing and :meth:`checkpoint`
        writes nothing (it returns the restored checkpoint's handle)."""
        return self._finished is not None

    def _log_restored(self, manifest: ManifestView | None) -> None:
        """One line on every restore: which checkpoint, which step, what is trained."""
        if manifest is None:
            log.info("run %s: no checkpoint yet, training from the start", self.run)
            return
        if self._finished is not None:
            log.info("run %s is finished: checkpoint %s (step %s) trained every record of "
                     "dataset %r; nothing left to train, nothing will be written (start a "
                     "new run name to train again)", self.run, manifest.name, manifest.step,
                     self.dataset_name)
            return
        p = self.progress()
        log.info("run %s resumed from checkpoint %s (step %s): epoch %s, %s records of "
                 "it already trained on rank %s, %s left", self.run, manifest.name,
                 manifest.step, p.epoch, p.records, self.rank, p.remaining)

    def _restored_skips(self, manifest: ManifestView | None,
                        rec: SessionRecord | None) -> tuple[str, ...] | None:
        """The skipped batches this rank carries on from the restored checkpoint: the
        manifest's (session record before version 4), else those of the rank objects
        this restore read that name this rank's partitions (its own object on the same
        layout): no object is read for them alone."""
        if manifest is None or rec is None:
            return None
        if rec.version < SKIPS_PER_RANK_VERSION:
            return rec.skipped
        return carried_skips(self._positions.known(manifest.name), self._mine(self._num_workers))

    def _record(self, manifest: ManifestView | None) -> SessionRecord | None:
        return None if manifest is None else self._check(manifest)

    def _apply_rank_state(self, rec: SessionRecord | None) -> RankState | None:
        """Set the saved seed and this rank's random states; returns its rank state."""
        if rec is None:
            return None
        if rec.seed is not None:
            self.seed = rec.seed
        if rec.version >= PER_RANK_VERSION:
            assert self._basis is not None
            mine = None if self.rank >= rec.world_size else \
                self._positions.object(self._basis[0], self.rank).state
        else:
            mine = rec.ranks.get(self.rank)
        if mine is None:
            return None
        if rec.world_size != self.world_size:
            log.warning(
                "restoring a checkpoint of world_size=%s on world_size=%s: every record is "
                "still trained once, but each rank's random states were saved for another "
                "rank layout, so the run is not bitwise an uninterrupted one",
                rec.world_size, self.world_size,
            )
        _rng.restore(mine.rng)
        return mine

    def _apply_offsets(self, manifest: ManifestView | None, rec: SessionRecord | None, *,
                       new_generation: bool) -> None:
        """Take (or keep) the generation on rank 0, then on every rank move the group of
        the partitions it reads to the checkpoint's offsets (:meth:`_place`): at a new
        generation, the same script raises their fences (:meth:`_take_and_place`)."""
        if self.rank == 0:
            self._call(self._redis.sadd, streams.groups_key(self.dataset_name), self.run)
        # A rollback keeps counting commits up: its lineage must outrank the
        # abandoned checkpoints (higher steps, same commit numbers).
        restored = rec.commit if rec is not None else 0
        self._commits = restored if new_generation else max(self._commits, restored)
        self._restored = rec
        self._basis = None if manifest is None or rec is None else (manifest, rec)
        if rec is not None:
            # Until a loader pass says otherwise, this rank reads what it read then.
            self._num_workers = rec.num_workers
        mine = self._mine(self._num_workers)
        if new_generation:
            self._take_and_place(rec.generation if rec is not None else 0, mine)
        else:
            self.generation = self._broadcast(self._gen() if self.rank == 0 else None)
            self._unplace()
            self._place(mine)
        self._consumed.place({}, {}, self._apply_rank_state(rec))
        for ds in self._datasets:
            ds.generation, ds.seed = self._gen(), self.seed

    def _take_and_place(self, floor: int, mine: list[int]) -> None:
        """Take a new fencing generation (rank 0, from the run's counter: O(1)) and
        place this rank's partitions at it, each script raising the fences of the
        partitions it moves (every rank, O(P/W); the ranks' partitions together are
        every partition once). One all-reduce of the highest fence found tells every
        rank at once that all fences hold it; rank 0 then closes the older readers. A
        fence above it refused that rank's placement, changing nothing: rank 0 takes
        another (:func:`~trainer_client.offsets.settle_generation`) and every rank
        places again (the same positions), or every rank refuses when a newer restore
        took over."""
        r, top, plan_gen = self._redis, None, 0
        for _ in range(ofs.TAKE_TRIES):
            plan: dict[str, Any] = {}
            if self.rank == 0:
                try:
                    if top is not None:
                        floor = self._call(ofs.settle_generation, r, self.dataset_name,
                                           self.run, plan_gen, top)
                    plan = {"gen": self._call(ofs.take_generation, r, self.dataset_name,
                                              self.run, floor)}
                except FencedError as exc:
                    plan = {"fenced": (exc.mine, exc.current)}
            plan = self._broadcast(plan)
            if "fenced" in plan:
                mine_gen, current = plan["fenced"]
                raise FencedError(group=self.run, mine=mine_gen, current=current,
                                  what="restore")
            plan_gen = self.generation = int(plan["gen"])
            self._unplace()
            try:
                self._place(mine)
                found = plan_gen
            except FencedError as exc:
                found = exc.current
            top = self._max_over_ranks(found)
            if top == plan_gen:
                if self.rank == 0:
                    self._call(ofs.evict_readers, r, self.dataset_name, self.run, plan_gen)
                return
        raise FencedError(group=self.run, mine=plan_gen, current=top or plan_gen,
                          what="restore")

    def _unplace(self) -> None:
        """Forget every placement: the next :meth:`_place` moves each partition again."""
        self._placed = set()
        self._consumed.reset({}, {}, None)

    def _max_over_ranks(self, value: int) -> int:
        """``value``'s maximum over the ranks: one all-reduce of one integer."""
        if self.world_size == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64, device=flag_device(self.process_group))
        dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(box.item())

    def rollback(self, state: Any, to_step: int | None = None, *,
                 reason: str | None = None) -> int:
        """Go back to a committed checkpoint (the newest, or ``to_step``): weights,
        offsets and random states together. The running ``batches`` generator drops
        what its loader prefetched and starts a new pass at the restored offsets.
        Returns the step. Raises :class:`NoRollbackTargetError` when the run has no
        committed checkpoint (nothing is changed then), ``LookupError`` when none of
        ``to_step`` exists. The run's incidents record it (``reason``: why, e.g. the
        spike guard's verdict)."""
        refuse_own_position(state)
        self.wait()
        self._committer.raise_background()
        with self._heal.phase("restore"):
            manifest = self._load(state, to_step)
        if manifest is None:
            raise NoRollbackTargetError(
                f"rollback of run {self.run!r} found no committed checkpoint to go back to: "
                "state and offsets are left as they are. Take a "
                "checkpoint before a rollback can be needed, or restart the run instead"
            )
        self._apply_offsets(manifest, self._record(manifest), new_generation=False)
        self._finished = None  # a rollback goes back to records left to train
        self._reseek = True
        self._clock.rolled_back(int(manifest.step), self.generation)
        self._heal.rolled_back(int(manifest.step), reason)
        return int(manifest.step)

    @staticmethod
    def inspect(
        store: CheckpointStoreAPI | str,
        state: Any,
        *,
        step: int | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> ManifestView:
        """Load a run's checkpoint (the one a restore would pick, or ``step``) into
        ``state`` for evaluation or export, read-only: no Redis, no fencing, no
        random states set, nothing written, so the running trainer goes on
        untouched. Returns its manifest (the session record is in ``extra``). Raises
        ``LookupError`` when the store holds no such checkpoint."""
        owned = isinstance(store, str)
        st = open_store(store, storage_options=storage_options) if isinstance(store, str) else store
        try:
            manifest = st.load(state, step=step)
            if manifest is None:
                raise LookupError(f"no committed checkpoint in {store!r} to inspect")
            return manifest
        finally:
            if owned:
                st.close()

