"""``TrainingSession``: restore, read and checkpoint so that every record trains once.

Call order (each method's docstring has the details)::

    session = TrainingSession(redis_url, dataset="tokens", run="exp42", store=url)
    step = session.restore(state)             # 1. weights + offsets + RNG, new generation
    loader = DataLoader(session.dataset(batch_size=32), batch_size=None, num_workers=2)
    for batch in session.batches(loader):     # 2. only what the loop consumed counts
        ...; step += 1
        session.checkpoint(state, step)       # 3. offsets go into the manifest
    session.checkpoint(state, step, blocking=True)   # 4. the steps since the last one
    session.close()

Bitwise resume (the default, deterministic mode, on the same world size and worker
count): a resumed run trains exactly the batches, in the same order, with the same
random numbers as an uninterrupted one. The session saves each rank's global random
states (torch CPU and CUDA, NumPy, Python ``random``) with every checkpoint and sets
them back on restore, and gives each DataLoader pass a generator derived from the run
seed, so iterating the loader never draws from the global generator. Anything with
``state_dict``/``load_state_dict`` in the state (LR schedulers, ...) is saved and
restored with it. On another world size or worker count every record is still
trained exactly once, but batches are formed differently, so bitwise identity
cannot hold (a warning says so). Greedy mode (``deterministic=False``) forms batches
from whatever partitions are ready: faster when partitions arrive unevenly, still
exactly once, but a resumed run's batches differ from an uninterrupted run's.

The checkpoint manifest is the truth: its ``extra["trainguard"]`` holds the consumed
offsets (per partition, the last stream ID the loop consumed), the dataset, the
partition count and the fencing generation (format: :mod:`trainguard.core.record`).
Only after the manifest is committed are entries
acknowledged (XACK) and the offsets published to Redis; a crash in between is
harmless, because restore moves the group to the manifest's offsets and acknowledges
again. A zombie (a trainer of the same run from before a newer restore) is refused by
the fence on every read, acknowledgement and checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainer_client import _rng, redis_client
from trainer_client import offsets as ofs
from trainer_client._checks import check_not_bypassed, warn_divergent
from trainer_client._commit import OffsetCommitter, PositionReader, gather_offsets
from trainer_client._consumed import Consumed, Snapshot
from trainer_client._healing import Healing
from trainer_client._loaders import in_worker_order, refuse_own_position, refuse_resuming_loader
from trainer_client._progress import EpochSizes, Progress, measure
from trainer_client._restore import REFUSALS, check_record, warn_if_reshaped
from trainer_client._timing import SaveClock
from trainer_client._uneven import UNEVEN_MODES, in_step
from trainer_client.dataset import Batch, StreamingDataset, load_spec
from trainer_client.errors import FencedError, NoRollbackTargetError, TrainerClientError
from trainer_client.health import HealthMonitor, HealthProbe, HealthReport, NodeHealth
from trainer_client.redis_retry import trainer_redis_breaker, trainer_redis_retrier
from trainer_client.watchdog import WatchdogConfig
from trainguard.core import record, streams
from trainguard.core.checkpoints import (
    CheckpointStoreAPI,
    CorruptCheckpointError,
    ManifestView,
    SaveHandleView,
    open_store,
    rank_state_store,
)
from trainguard.core.incidents import LoopPolicy
from trainguard.core.interval import Advice, IntervalPolicy
from trainguard.core.newest import newest_first
from trainguard.core.rank_record import Positions, RankRecord
from trainguard.core.record import PER_RANK_VERSION, RankState, SessionRecord
from trainguard.core.timing import TIMING_KEY

__all__ = ["TrainingSession"]

log = logging.getLogger(__name__)

class TrainingSession:
    """Ties a run's checkpoints to its consumer group. See the module docstring.

    ``store`` is a ``CheckpointStore`` or its URL (then ``keep_last``, ``keep_every``,
    ``storage_options`` and ``process_group`` configure the one made here).
    ``deterministic`` (default True) makes resumes bitwise; False is greedy mode
    (see the module docstring for what it trades away). ``seed`` is the run seed
    DataLoader passes derive their generators from (default: from the run name; a
    restored checkpoint's seed wins). ``health_monitor`` (optional) answers
    :meth:`health`. ``interval`` tunes the checkpoint interval advisor behind
    :meth:`should_checkpoint`. With ``world_size > 1``, call
    ``dist.init_process_group`` first (gloo works on CPU; or
    :func:`trainer_client.init_process_group`, with the watchdog's collective
    timeout); every rank then calls
    ``restore``, ``checkpoint`` and ``rollback`` in the same order, and ``batches``
    keeps the ranks in step.

    ``watchdog`` (a :class:`~trainer_client.watchdog.WatchdogConfig`; False: off;
    default ``$TRAINGUARD_WATCHDOG``) exits a process that makes no progress (exit 86)
    and tightens the collective timeout; ``loop_breaker`` (a
    :class:`~trainguard.core.incidents.LoopPolicy`; False: off; default
    ``$TRAINGUARD_LOOP_BREAKER``) answers a failure that repeats after restores (older
    checkpoint, skipped batches, then exit 87). Every attempt and failure is recorded
    in Redis (:mod:`trainguard.core.incidents`); :meth:`close` marks the attempt ok.
    """

    def __init__(
        self,
        redis_url: str,
        *,
        dataset: str,
        run: str,
        store: CheckpointStoreAPI | str,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 3,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
        deterministic: bool = True,
        seed: int | None = None,
        block_ms: int = 1000,
        redis_timeout_s: float = 900.0,
        health_monitor: HealthMonitor | None = None,
        interval: IntervalPolicy | None = None,
        watchdog: WatchdogConfig | bool | None = None,
        loop_breaker: LoopPolicy | bool | None = None,
    ) -> None:
        streams.check_name("dataset", dataset)
        streams.check_name("run", run)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if world_size > 1 and not dist.is_initialized():
            raise ValueError(
                f"world_size={world_size} needs torch.distributed initialised first "
                "(e.g. dist.init_process_group('gloo')): offsets of all ranks end in one manifest"
            )
        self.redis_url = redis_url
        self.dataset_name = dataset
        self.run = run
        self.rank = rank
        self.world_size = world_size
        self.deterministic = deterministic
        self.block_ms = block_ms
        self.redis_timeout_s = redis_timeout_s
        self.process_group = process_group
        self._redis = redis_client.client(redis_url, socket_timeout=30, socket_connect_timeout=5)
        # Every Redis call goes through one breaker and waits out an outage (restart,
        # AOF loading) for up to redis_timeout_s instead of failing the training step.
        self._call = trainer_redis_retrier(trainer_redis_breaker(f"redis:{run}"), redis_timeout_s).call
        try:
            self.spec = self._call(load_spec, self._redis, dataset)
            self._owns_store = isinstance(store, str)
            self.store: CheckpointStoreAPI = open_store(
                store, keep_last=keep_last, keep_every=keep_every,
                storage_options=storage_options, process_group=process_group,
            ) if isinstance(store, str) else store
        except BaseException:
            self._redis.close()
            raise
        self.generation: int | None = None
        self._consumed = Consumed(self.spec.partitions)
        self._commits = 0
        self._num_workers = 0
        self._restored: SessionRecord | None = None
        # Per-rank state objects when the store has them: no rank gathers offsets.
        self._rank_store = rank_state_store(self.store)
        self._positions = PositionReader(self._rank_store)
        self._basis: tuple[ManifestView, SessionRecord] | None = None
        self._placed: set[int] = set()
        self._committer = OffsetCommitter(self._redis, self._call, self.store,
                                          dataset=dataset, run=run, reader=self._positions)
        self._reseek = False
        self._datasets: list[StreamingDataset] = []
        self.seed = _rng.default_seed(run) if seed is None else int(seed)
        self._sizes = EpochSizes(self._redis, dataset, self.spec.partitions)
        self.health_monitor = health_monitor
        self._health = NodeHealth(health_monitor)
        self._clock = SaveClock(interval)
        try:
            self._heal = Healing(redis_url, dataset=dataset, run=run, rank=rank,
                                 world_size=world_size, call=self._call,
                                 broadcast=self._broadcast, process_group=process_group,
                                 watchdog=watchdog, loop_breaker=loop_breaker)
        except BaseException:
            self._redis.close()
            raise

    def watch(self, phase: str, limit_s: float) -> contextlib.AbstractContextManager[None]:
        """A block between steps (evaluation, a long log write) that may run for up to
        ``limit_s`` seconds without the watchdog taking it for a hang."""
        return self._heal.phase(phase, limit_s)

    def collective_timeout(self) -> timedelta:
        """The collective timeout from the watchdog's figures now: the session sets it
        on ``process_group`` itself; use it for the groups the script makes."""
        return self._heal.collective_timeout()

    # ------------------------------------------------------------------ helpers

    def _gen(self) -> int:
        if self.generation is None:
            raise RuntimeError("call session.restore(state) before reading or checkpointing")
        return self.generation

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        return box[0]

    @property
    def offsets(self) -> dict[int, str]:
        """Per partition, the last stream ID the training loop consumed (all ranks'
        partitions as of the last restore, this rank's as consumed since)."""
        return self._consumed.snapshot().offsets

    # ------------------------------------------------------------------ restore

    @property
    def last_commit_offsets_s(self) -> float | None:
        """Seconds the last checkpoint spent acknowledging and publishing offsets."""
        return self._committer.last_publish_s

    def checkpoints(self) -> list[ManifestView]:
        """The store's committed checkpoints (manifests; one store per run), in the
        order restores prefer them (:func:`trainguard.core.newest.restore_order`).
        ``rollback(state, to_step)`` loads the first of them with that step."""
        return newest_first(self.store.list())

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
        self._clock.count_failures(self._heal.failures)
        step = int(manifest.step) if manifest is not None else 0
        self._heal.restored(step, rec, self.generation)
        self._log_restored(manifest)
        return step

    def _log_restored(self, manifest: ManifestView | None) -> None:
        """One line on every restore: which checkpoint, which step, what is trained."""
        if manifest is None:
            log.info("run %s: no checkpoint yet, training from the start", self.run)
            return
        p = self.progress()
        log.info("run %s resumed from checkpoint %s (step %s): epoch %s, %s records of "
                 "it already trained on rank %s, %s left", self.run, manifest.name,
                 manifest.step, p.epoch, p.records, self.rank, p.remaining)

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
        the partitions it reads to the checkpoint's offsets (:meth:`_place`)."""
        gen = None
        if self.rank == 0:
            r = self._redis
            self._call(r.sadd, streams.groups_key(self.dataset_name), self.run)
            if new_generation:
                floor = rec.generation if rec is not None else 0
                gen = self._call(ofs.bump_generation, r, self.dataset_name, self.run,
                                 self.spec.partitions, floor)
            else:
                gen = self._gen()
        # Every rank seeks after this: the fences hold the new generation by then.
        gen = self._broadcast(gen)
        self.generation = gen
        # A rollback keeps counting commits up: its lineage must outrank the
        # abandoned checkpoints (higher steps, same commit numbers).
        restored = rec.commit if rec is not None else 0
        self._commits = restored if new_generation else max(self._commits, restored)
        self._restored = rec
        self._basis = None if manifest is None or rec is None else (manifest, rec)
        if rec is not None:
            # Until a loader pass says otherwise, this rank reads what it read then.
            self._num_workers = rec.num_workers
        self._placed = set()
        self._consumed.reset({}, {}, None)
        self._place(self._mine(self._num_workers))
        self._consumed.place({}, {}, self._apply_rank_state(rec))
        for ds in self._datasets:
            ds.generation, ds.seed = gen, self.seed

    def _mine(self, num_workers: int) -> list[int]:
        return streams.rank_partitions(self.spec.partitions, world_size=self.world_size,
                                       num_workers=num_workers, rank=self.rank)

    def _place(self, partitions: list[int]) -> Positions | None:
        """Move the group of those of ``partitions`` not placed since the restore to
        their offsets in the newest checkpoint (the restored one, or this session's
        latest commit), reading only the objects of the ranks that owned them; then
        acknowledge up to them. O(partitions + objects read)."""
        todo = [p for p in partitions if p not in self._placed]
        if not todo:
            return None
        basis = self._basis
        if self._placed and self._committer.last_committed is not None:
            # A loader of another worker count moved partitions between ranks: their
            # newest positions are in this run's latest commit.
            self._committer.wait()
            basis = self._committer.last_committed
        if basis is None:
            pos = Positions({p: streams.ZERO_ID for p in todo}, {p: 0 for p in todo}, {})
        else:
            pos = self._positions.positions(basis[0], basis[1], todo)
        gen, r = self._gen(), self._redis
        self._call(ofs.seek_group, r, self.dataset_name, self.run, gen, pos.offsets,
                   batches=pos.batches, write=True)
        self._call(ofs.ack_upto, r, self.dataset_name, self.run, gen, pos.offsets)
        self._consumed.place(pos.offsets, pos.batches)
        self._placed.update(todo)
        return pos

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

    # ------------------------------------------------------------------ reading

    def dataset(
        self,
        batch_size: int,
        *,
        decode: Callable[[Any], Any] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        straddle_epochs: bool = False,
        epochs: int | None = None,
    ) -> StreamingDataset:
        """A :class:`StreamingDataset` of this run's rank; pass it to a DataLoader with
        ``batch_size=None`` and iterate that through :meth:`batches`. Batches span
        this rank's partitions and never hold two epochs: only a worker's last batch
        of an epoch may be short, or with ``drop_last`` is consumed (acknowledged)
        without being trained; ``straddle_epochs=True`` fills batches across
        epochs instead. ``epochs``: train this many epochs (up to the dataset's own;
        any number of an endless one, whose producer writes epochs as they drain)."""
        ds = StreamingDataset(
            self.redis_url,
            self.dataset_name,
            self.run,
            batch_size=batch_size,
            rank=self.rank,
            world_size=self.world_size,
            decode=decode,
            collate=collate,
            deterministic=self.deterministic,
            drop_last=drop_last,
            straddle_epochs=straddle_epochs,
            epochs=epochs,
            seed=self.seed,
            # May be made before restore (to size an LR schedule from progress()):
            # restore then hands it the new generation.
            generation=self.generation or 0,
            block_ms=self.block_ms,
            reconnect_timeout_s=self.redis_timeout_s,
            spec=self.spec,
        )
        ds.session_made = True
        self._datasets.append(ds)
        return ds

    def _owned(self, num_workers: int) -> dict[int, list[int]]:
        return {
            w: streams.assign_partitions(
                self.spec.partitions,
                world_size=self.world_size,
                num_workers=num_workers,
                rank=self.rank,
                worker=w,
            )
            for w in range(max(1, num_workers))
        }

    def _loop_batches(self, source: Iterator[Batch]) -> Iterator[Batch]:
        """The batches the loop gets: end markers skipped, dropped tails recorded."""
        for batch in source:
            if batch.final:
                continue
            if batch.dropped:
                self._consumed.record(batch)
                continue
            yield batch

    def batches(
        self, loader: Iterable[Batch], *, uneven: str = "join",
        health: HealthMonitor | None = None,
    ) -> Iterator[Batch]:
        """Yield the loader's batches, recording each one's offsets as consumed when it
        is handed to the loop. Before each pass over the loader, the seek of this
        rank's partitions is set to the consumed offsets, so a pass never skips what an
        abandoned pass had prefetched; and the loader gets a generator derived from
        the run seed (unless it has one), so the pass leaves the global random state
        as the restore set it. In deterministic mode, batches come in the order an
        uninterrupted run would have had them (the loader's workers are merged by
        each worker's batch index).

        With several ranks, every rank leaves the loop in the same iteration (see
        :mod:`trainer_client._uneven`): ``uneven="join"`` hands a rank that ran out
        empty batches (``len(batch) == 0``) until all are out; ``"stop"`` ends the
        loop everywhere when the first rank runs out. The same per-step all-reduce
        carries each rank's GPU verdict (``health``, default the session's
        ``health_monitor``): once one rank's is CRITICAL, every rank raises at the same
        step boundary (GpuCriticalError there, PeerGpuCriticalError on the others)."""
        if uneven not in UNEVEN_MODES:
            raise ValueError(f"uneven must be one of {UNEVEN_MODES}, got {uneven!r}")
        refuse_resuming_loader(loader)
        num_workers = int(getattr(loader, "num_workers", 0))
        if self.deterministic:
            warn_if_reshaped(self._restored, self.world_size, num_workers)
        self._num_workers = num_workers
        owned = self._owned(num_workers)
        mine = sorted(p for ps in owned.values() for p in ps)
        self._place(mine)
        while True:
            self._reseek = False
            positions, counts = self._consumed.start_pass(mine)
            self._call(
                ofs.write_seek, self._redis, self.dataset_name, self.run, self._gen(),
                positions, counts,
            )
            ds = loader if isinstance(loader, StreamingDataset) else getattr(loader, "dataset", None)
            if isinstance(ds, StreamingDataset):
                # Full table: the partitions of any rank could be asked for (a
                # dataset made elsewhere); ours are the ones that changed.
                ds.seek = self._consumed.seek_table()
            if getattr(loader, "generator", False) is None:
                loader.generator = _rng.loader_generator(  # type: ignore[attr-defined]
                    self.seed, self.rank, sum(counts.values()))
            it = iter(loader)
            source: Iterator[Batch] = it
            try:
                if self.deterministic:
                    nxt = {w: sum(counts[p] for p in ps) for w, ps in owned.items()}
                    source = in_worker_order(it, nxt)
                source = self._loop_batches(source)
                if self.world_size > 1:
                    source = in_step(source, mode=uneven, group=self.process_group,
                                     monitor=health or self.health_monitor)
                for batch in source:
                    self._consumed.record(batch)
                    if self._heal.handing(batch):
                        yield batch
                    if self._reseek:
                        break
                else:
                    self._heal.loop_ended()
                    return
            finally:
                # Close the abandoned pass's generators now: their frames hold the
                # loader's iterator (and with it, without workers, the reader's Redis
                # connections) until closed.
                close = getattr(source, "close", None)
                if close is not None:
                    close()
                if isinstance(ds, StreamingDataset):
                    ds.seek = None  # a pass not started here is refused (bypass)
                # Stop an abandoned pass's workers before the next pass seeks, so none
                # of them reads on. Persistent workers stay: the loader's next pass
                # resets them, and each starts its new pass at the seek.
                if not getattr(loader, "persistent_workers", False):
                    shutdown = getattr(it, "_shutdown_workers", None)
                    if shutdown is not None:
                        shutdown()
                del it

    def progress(self) -> Progress:
        """Where this rank stands in the current epoch: the epoch, the batches and
        records consumed in it, the records remaining, and the steps an epoch takes
        for this world size, worker count and batch size (from the latest
        :meth:`dataset`). Exact once the producer has finished the epoch, estimated
        from what it produced so far before that (``exact``). Reads Redis (a few
        commands): call it every few steps, not in the innermost loop."""
        mine = sorted(p for ps in self._owned(self._num_workers).values() for p in ps)
        return measure(
            self._consumed.snapshot(), lambda e: self._call(self._sizes.get, e), mine,
            world_size=self.world_size, num_workers=self._num_workers,
            dataset=self._datasets[-1] if self._datasets else None, epochs=self.spec.epochs,
        )

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
        and the retention floor are published. A fenced trainer is refused here, and a
        refusal met in the background is raised by the next call. ``skipped`` lists
        the batches consumed but never trained (the session record carries them).
        """
        for key in (record.RECORD_KEY, record.SKIPPED_KEY, TIMING_KEY):
            if extra is not None and key in extra:
                raise ValueError(f"extra must not use the key {key!r}: the session writes it")
        refuse_own_position(state)
        self._committer.raise_background()
        gen = self._gen()
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
            warn_divergent(state, self.world_size, self.process_group)
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
            skipped=None if skipped is None else tuple(skipped),
            seed=self.seed,
            ranks={} if per_rank else ranks,
            version=PER_RANK_VERSION if per_rank else 2,
        )
        doc = {**(extra or {}), **rec.to_extra(), **self._clock.extra(step)}
        started = time.monotonic()
        if self._rank_store is not None:
            parts = self._mine(self._num_workers)
            own = RankRecord(rank=self.rank, world_size=self.world_size,
                             num_workers=self._num_workers,
                             offsets={p: now.offsets[p] for p in parts},
                             batches={p: now.batches[p] for p in parts}, state=mine)
            handle = self._rank_store.save(state, step=step, extra=doc, blocking=blocking,
                                           rank_state=own.to_wire())
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
        """Whether to checkpoint now: the loop has trained the interval the advisor
        recommends (:meth:`checkpoint_advice`) since the last save or restore. Call it
        every step with the step reached; it reads a clock, nothing remote. With
        ``world_size > 1`` every rank calls it (rank 0's answer is broadcast, so all
        ranks checkpoint together)."""
        return bool(self._broadcast(self._clock.should_checkpoint(step)))

    def checkpoint_advice(self) -> Advice | None:
        """The recommended interval (Young/Daly, :mod:`trainguard.core.interval`)
        from this run's measured save times and restart history (carried over
        restores in the manifests); None before a save was measured."""
        return self._clock.advice()

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait until every checkpoint started here committed and acknowledged."""
        with self._heal.phase("checkpoint"):
            self._committer.wait(timeout_s)

    def close(self) -> None:
        """Wait for in-flight checkpoints, then release connections (and the store
        when the session made it). Raises a fencing refusal met in the background."""
        try:
            self.wait()
            self._committer.raise_background()
            self._heal.closed()
        finally:
            self._heal.close()
            self._health.close()
            if self._owns_store:
                self.store.close()
            self._redis.close()

    # ------------------------------------------------------------------ health

    def health(
        self, monitor: HealthMonitor | None = None, *, probe: HealthProbe | None = None
    ) -> HealthReport:
        """GPU health of this node: the latest report of ``monitor`` (default: the
        session's ``health_monitor``), probing now if it has none yet; without a
        monitor, a probe now with ``probe`` or the session's own (made on first use,
        closed by :meth:`close`). A node without GPUs reports ``no_gpu=True``."""
        return self._health.report(monitor, probe=probe)

    def __enter__(self) -> TrainingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
